"""From the flags of `memfit estimate` and `memfit fit` to what they price: the model, the GPU, the
candidate of each combination, the settings, the estimate on this job (`pricer`) and the
configuration as the output states it."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from memfit.estimate.advice import default_ref
from memfit.estimate.cli_checks import check_flags, check_space, combinations, fill_defaults
from memfit.estimate.cli_parser import SPACE_FLAGS, given_flags
from memfit.estimate.cli_render import describe
from memfit.estimate.cli_settings_flags import CPU_HEADROOM
from memfit.estimate.core import Estimate, estimate
from memfit.estimate.memory.method_terms import shape
from memfit.estimate.models import catalog
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.models.catalog import GPU
from memfit.estimate.settings import DEFAULT_SETTINGS, EstimateError, Settings
from memfit.methods import kernels_problems, speed_problems
from memfit.space import Candidate
from memfit.units import GIB, MIB


def load_model(name: str) -> ModelArch:
    try:
        return catalog.model(name, allow_moe=True)
    except UnicodeDecodeError:
        path = Path(name)
        path = path / "config.json" if path.is_dir() else path
        raise EstimateError(f"{path}: not UTF-8 text (expected a JSON config.json)") from None
    except (ValueError, FileNotFoundError, KeyError, OSError) as exc:
        raise EstimateError(str(exc).strip("'\"")) from None


def load_gpu(name: str) -> GPU:
    try:
        return catalog.gpu(name)
    except (ValueError, KeyError) as exc:
        raise EstimateError(str(exc).strip("'\"")) from None


def candidate_of(args, arch: ModelArch) -> Candidate:
    """The candidate of one combination of flags (defaults filled)."""
    context = arch.max_position_embeddings
    searched = getattr(args, "maximize", None) == "seq_len"  # fit searches up to the context
    if context and args.seq_len > context and not args.allow_beyond_context and not searched:
        raise EstimateError(
            f"--seq-len {args.seq_len} is beyond {arch.name}'s context of {context} tokens "
            "(max_position_embeddings); pass --allow-beyond-context to estimate it anyway"
        )
    ref = args.ref or default_ref(args.finetune, args.method)
    accum = args.grad_accum
    if getattr(args, "global_batch", None) is not None:
        # as the workflow makes every candidate train train.global_batch (WorkflowConfig.candidates)
        ranks = args.num_gpus * args.num_nodes // max(args.sequence_parallel, 1)
        per_step = args.micro_batch * ranks
        if args.global_batch % per_step:
            raise EstimateError(
                f"--global-batch {args.global_batch} is not a multiple of --micro-batch {args.micro_batch} x "
                f"{ranks} data-parallel ranks"
            )
        accum = args.global_batch // per_step
    try:
        cand = Candidate(
            zero=args.zero,
            offload_optimizer=args.offload_optimizer,
            offload_param=args.offload_param,
            pin_memory=args.pin_memory,
            offload_ratio=args.offload_ratio,
            grad_ckpt=args.grad_ckpt,
            attn=args.attn,
            finetune=args.finetune,
            lora_rank=args.lora_rank or 16,
            micro_batch=args.micro_batch,
            seq_len=args.seq_len,
            grad_accum=accum,
            precision=args.precision,
            ref=ref,
            loss_impl=args.loss_impl,
            sequence_parallel=args.sequence_parallel,
            tiled_mlp=args.tiled_mlp,
            activation_offload=args.activation_offload,
            padding_free=args.padding_free,
            compile=args.compile,
            kernels=args.kernels,
        )
    except ValueError as exc:
        raise EstimateError(str(exc)) from None
    # the trainer's rule for padding_free (methods, sequence parallelism), in the flags' words
    problems = speed_problems(args.method, args.padding_free, args.sequence_parallel)
    if problems:
        said = "; ".join(p.removeprefix("padding_free: ") for p in problems)
        raise EstimateError("--padding-free: " + said.replace("set it to false", "drop --padding-free"))
    for problem in kernels_problems(args.method, args.kernels):  # liger: sft and dpo (the trainer's rule)
        raise EstimateError("--" + problem.replace("set kernels: none", "use --kernels none"))
    return cand


def settings_of(args) -> Settings:
    targets = tuple(t.strip() for t in args.lora_targets.split(",")) if args.lora_targets else None
    settings = dataclasses.replace(
        DEFAULT_SETTINGS,
        lora_targets=targets,
        sub_group_size=args.sub_group_size,
        expandable_segments=args.expandable_segments,
        activations=args.activations,
        trace_cache=args.trace_cache,
        loss_chunk_tokens=args.loss_chunk_tokens,
        mlp_tile_tokens=args.mlp_tile_tokens,
        logits_handling=args.logits_handling,
        trainer_loader=args.trainer_loader,
        nccl_bytes=None if args.nccl_mib is None else int(args.nccl_mib * MIB),
        step_time_calibration=args.step_time_calibration,
        row_tokens=args.row_tokens,
    )
    if args.cpu_adam_rate is not None:
        settings = dataclasses.replace(settings, cpu_adam_params_per_s_per_core=args.cpu_adam_rate)
    if args.cpu_cores_per_rank is not None:
        settings = dataclasses.replace(settings, cpu_cores_per_rank=args.cpu_cores_per_rank)
    return settings


def budget_bytes(args) -> int | None:
    if args.budget_gib:
        return int(args.budget_gib * GIB)
    return int(args.budget_gb * 1e9) if args.budget_gb else None


def host_memory_gb(args) -> float | None:
    """The core takes decimal GB (the catalog's unit for host RAM)."""
    if args.host_memory_gib:
        return args.host_memory_gib * GIB / 1e9
    return args.host_memory_gb


def headroom_of(args, gpu: GPU) -> float | None:
    """The headroom asked for; None (the margin derived from memfit's measured error, said in the
    verdict) on a GPU; CPU_HEADROOM on the cpu, whose memory no GPU evidence measured."""
    if args.headroom is not None:
        return args.headroom
    return CPU_HEADROOM if gpu.name == "cpu" else None


def pricer_on(args, arch: ModelArch, gpu: GPU, settings: Settings) -> Callable[[Candidate, int, int], Estimate]:
    """The estimate of a candidate on another number of GPUs per node and nodes."""

    def price_on(cand: Candidate, num_gpus: int, num_nodes: int) -> Estimate:
        return estimate(
            arch,
            gpu,
            num_gpus,
            num_nodes,
            args.method,
            cand,
            host_memory_gb(args),
            budget_bytes(args),
            settings,
            headroom=headroom_of(args, gpu),
        )

    return price_on


def pricer(args, arch: ModelArch, gpu: GPU, settings: Settings) -> Callable[[Candidate], Estimate]:
    def price(cand: Candidate) -> Estimate:
        return estimate(
            arch,
            gpu,
            args.num_gpus,
            args.num_nodes,
            args.method,
            cand,
            host_memory_gb(args),
            budget_bytes(args),
            settings,
            headroom=headroom_of(args, gpu),
        )

    return price


# dest -> the flag as the user types it, for "defaults taken"
FLAG = {dest: "--" + dest.replace("_", "-") for dest in (*SPACE_FLAGS, "ref", "lora_rank")}


def configuration(args, given: set[str], arch: ModelArch, gpu: GPU, cand: Candidate, settings: Settings) -> dict:
    """The configuration priced, for the table and `--json`: every lever, the defaults taken, and
    where the host RAM and the device memory came from."""
    if args.host_memory_gib is not None or args.host_memory_gb is not None:
        flag = "--host-memory-gib" if args.host_memory_gib is not None else "--host-memory-gb"
        host_gb, source = host_memory_gb(args), f"given ({flag})"
    else:
        host_gb = gpu.typical_host_memory_gb
        source = (
            f"the catalog's typical {gpu.name} node ({gpu.typical_host_memory_gb:g} GB; --host-memory-gib sets yours)"
        )
    defaults = {}
    for dest in ("finetune", "zero", "grad_ckpt", "attn", "loss_impl", "precision", "micro_batch", "seq_len"):
        if dest not in given and not (dest == getattr(args, "maximize", None)):
            value = getattr(cand, dest)
            defaults[FLAG[dest]] = ("on" if value else "off") if dest == "grad_ckpt" else value
    if shape(args.method).reference and "ref" not in given:
        defaults["--ref"] = cand.ref
    if cand.finetune != "full" and "lora_rank" not in given:
        defaults["--lora-rank"] = cand.lora_rank
    return {
        "model": arch.name,
        "gpu": gpu.name,
        "num_gpus": args.num_gpus,
        "num_nodes": args.num_nodes,
        "method": args.method,
        "candidate": cand.to_dict(),
        "lora_targets": list(settings.lora_targets) if settings.lora_targets else None,
        "words": describe(cand, args.method, settings.lora_targets),
        "defaults_taken": defaults,
        "host_memory": {"bytes": int(host_gb * 1e9), "source": source},
        "device_memory": "given (--budget-gib/--budget-gb)" if budget_bytes(args) else f"the {gpu.name}'s",
    }


def progress(say: Callable[[str], None] | None):
    """While inside, a model being traced reports each traced shape to `say` (the tracer's
    memfit.estimate.trace.trace.progress_to; nothing where the tracer has no such hook)."""
    from memfit.estimate.trace import trace

    hook = getattr(trace, "progress_to", None)
    return hook(say) if hook is not None and say is not None else contextlib.nullcontext()


def advice_on(args, result: Estimate) -> bool:
    """--advice, or by default unless the model is traced (where each lever traces again)."""
    if args.advice is not None:
        return args.advice
    return result.activations_source != "traced"


def prepare(args, prog: str, argv: list[str] | None, fit: bool):
    """The parsed flags as (combinations, arch, gpu, settings, given)."""
    given = given_flags(prog, fit, list(sys.argv[1:] if argv is None else argv))
    combos = combinations(args, SPACE_FLAGS)
    if fit and len(combos) > 1:
        many = [FLAG[d] for d in SPACE_FLAGS if getattr(args, d) and len(getattr(args, d)) > 1]
        raise EstimateError(
            f"memfit fit takes one value per flag, got a list for {', '.join(many)}; rank the "
            "combinations with `memfit estimate`, then fit the one you choose"
        )
    if len(combos) == 1:
        check_flags(combos[0])
    else:
        check_space(combos)
    for one in combos:
        fill_defaults(one)
    arch, gpu = load_model(args.model), load_gpu(args.gpu)
    return combos, arch, gpu, settings_of(combos[0]), given


def say_to(prog: str) -> Callable[[str], None]:
    def say(line: str) -> None:
        print(f"{prog}: {line}", file=sys.stderr, flush=True)

    return say


class _Terminated(BaseException):
    """SIGTERM, raised where the main thread is (sigterm_unwinds)."""


def sigterm_unwinds(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """A CLI entry on which SIGTERM (a cancelled SLURM job, `timeout`, kill) unwinds as Ctrl-C
    does: raised as an exception, so that every `finally` on the way out runs (the trace
    workers' pool terminates its workers: memfit.estimate.trace.trace_children._pool; an atomic
    write removes its temporary file), then the process dies of SIGTERM as it would have, the
    same status for a shell or a scheduler. A process whose SIGTERM is already handled or
    ignored, or a call outside the main thread (where no handler can be set), keeps its own."""

    @functools.wraps(main)
    def entry(argv: list[str] | None = None) -> int:
        if threading.current_thread() is not threading.main_thread():
            return main(argv)
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return main(argv)

        def unwind(signum, frame):
            raise _Terminated

        signal.signal(signal.SIGTERM, unwind)
        try:
            return main(argv)
        except _Terminated:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)  # the default action: this process ends here
            raise SystemExit(128 + signal.SIGTERM) from None  # in case it is delivered late
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    return entry
