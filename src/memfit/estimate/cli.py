"""`memfit estimate` and `memfit fit`: parse the flags, run the estimate, print the table or
the JSON, exit 0 (fits), 1 (does not fit) or 2 (bad input, or hardware that cannot run it).

    memfit estimate --model qwen2-7b --gpu rtx4090 --num-gpus 4 --zero 3 --seq-len 128 --json
    memfit fit --maximize seq_len --model glm-4-9b --gpu a100-80gb --num-gpus 8 --method dpo
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from memfit.estimate import catalog
from memfit.estimate.arch import ModelArch
from memfit.estimate.calibration import UNCALIBRATED_MARGIN
from memfit.estimate.catalog import GPU
from memfit.estimate.cli_checks import check_flags, fill_defaults, search_bound
from memfit.estimate.core import Estimate, estimate
from memfit.estimate.fit import maximize
from memfit.estimate.settings import DEFAULT_SETTINGS, LOGITS_HANDLING, TRAINER_LOADERS, EstimateError, Settings
from memfit.space import Candidate
from memfit.units import GIB, MIB, gib


def _parser(prog: str, maximize: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Largest seq_len or micro_batch that fits."
            if maximize
            else "Predict peak GPU memory, host memory and step time of one fine-tuning configuration."
        ),
    )
    if maximize:
        p.add_argument("--maximize", required=True, choices=["seq_len", "micro_batch"])
        p.add_argument(
            "--max-seq-len",
            type=int,
            default=None,
            help="seq_len: the longest length searched (default: the model's context, or with "
            "--allow-beyond-context as long as memory allows)",
        )
    _add_job_args(p)
    _add_lever_args(p)
    _add_budget_args(p)
    _add_trace_args(p)
    return p


def _add_job_args(p: argparse.ArgumentParser) -> None:
    """What is trained where: model, GPUs, method, fine-tuning, shapes."""
    p.add_argument("--model", required=True, help="catalog name, a HF config.json, or a model directory")
    p.add_argument("--gpu", required=True, help="GPU catalog name, or cpu")
    p.add_argument("--num-gpus", type=int, default=1, help="GPUs (ranks) per node")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--method", choices=["sft", "dpo"], default="sft")
    p.add_argument("--finetune", choices=["full", "lora", "qlora"], default="full")
    p.add_argument("--lora-rank", type=int, default=None, help="LoRA rank (default 16)")
    p.add_argument(
        "--lora-targets",
        default=None,
        help="comma-separated linear names (default: every linear of the decoder layer)",
    )
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 2048)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per GPU per micro step (default 1)")
    p.add_argument("--grad-accum", type=int, default=1)


def _add_lever_args(p: argparse.ArgumentParser) -> None:
    """The search levers: precision, checkpointing, attention, loss, ZeRO, offload, reference."""
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--grad-ckpt", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--attn", choices=["flash", "sdpa", "eager"], default="flash")
    p.add_argument(
        "--loss-impl",
        choices=["full", "chunked"],
        default="full",
        help="full: logits then fp32 log-softmax | chunked: per token chunk, recomputed in backward",
    )
    p.add_argument(
        "--loss-chunk-tokens",
        type=int,
        default=None,
        help="chunked: tokens per chunk (default: 256 MiB of fp32 logits a chunk)",
    )
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=3)
    p.add_argument("--offload-optimizer", choices=["none", "cpu"], default="none")
    p.add_argument("--offload-param", choices=["none", "cpu"], default="none")
    p.add_argument("--pin-memory", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--offload-ratio", type=float, default=1.0)
    p.add_argument(
        "--sequence-parallel",
        type=int,
        default=1,
        help="Ulysses sequence parallelism: GPUs that split each sequence (DeepSpeed ALST)",
    )
    flag = argparse.BooleanOptionalAction
    p.add_argument("--tiled-mlp", action=flag, default=False, help="DeepSpeed ALST's TiledMLP: MLPs a tile at a time")
    p.add_argument(
        "--mlp-tile-tokens", type=int, help="tiled MLP: tokens per sequence in a tile (default: hidden size)"
    )
    p.add_argument("--activation-offload", action=flag, default=False, help="checkpointed layer inputs to host RAM")
    p.add_argument(
        "--sub-group-size",
        type=int,
        default=DEFAULT_SETTINGS.sub_group_size,
        help="ZeRO-3 optimizer sub-group size, elements",
    )
    p.add_argument(
        "--ref",
        choices=["precomputed", "model", "adapter"],
        default=None,
        help="DPO reference (default: model for full, adapter for LoRA)",
    )


def _add_budget_args(p: argparse.ArgumentParser) -> None:
    """Memory limits and what the trainer around the model holds."""
    p.add_argument("--host-memory-gib", type=float, default=None, help="RAM per node, GiB (2**30 bytes)")
    p.add_argument(
        "--host-memory-gb",
        type=float,
        default=None,
        help="RAM per node in decimal GB (1e9 bytes); kept for old scripts, prefer --host-memory-gib",
    )
    p.add_argument("--budget-gib", type=float, default=None, help="use this many GiB as the device memory")
    p.add_argument(
        "--budget-gb",
        type=float,
        default=None,
        help="device memory in decimal GB (1e9 bytes); prefer --budget-gib",
    )
    p.add_argument(
        "--headroom",
        type=float,
        default=None,
        help="fraction of device memory kept free, as the workflow's `headroom:` (default: the margin memfit's "
        f"measured device-total error calls for, 5%% on a GPU with a calibration file (H100, H200), "
        f"{UNCALIBRATED_MARGIN * 100:.0f}%% on others; {CPU_HEADROOM} on the cpu, where none was measured)",
    )
    p.add_argument(
        "--allow-beyond-context",
        action="store_true",
        help="allow --seq-len beyond the model's max_position_embeddings",
    )
    p.add_argument(
        "--expandable-segments",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    )
    p.add_argument(
        "--logits-handling",
        choices=list(LOGITS_HANDLING),
        default="memfit",
        help="how the trainer holds the [tokens, vocab] logits around its loss: memfit (its own "
        "trainer), hf-model-fp32 (transformers <= 4.45), hf-loss-function (transformers >= 4.46), "
        "torchtune-held (torchtune recipes without `del logits`)",
    )
    p.add_argument(
        "--trainer-loader",
        choices=list(TRAINER_LOADERS),
        default="memfit",
        help="how a resume loads the optimizer state: memfit (its trainer copies it into the state "
        "that exists) or deepspeed (DeepSpeed's own load, as other trainers on DeepSpeed run it: at "
        "ZeRO-0 in 16-bit m and v are held twice while it loads)",
    )
    p.add_argument(
        "--nccl-mib",
        type=float,
        default=None,
        help="NCCL communicator memory per GPU process when world > 1, MiB (default 1.79 GiB: "
        "NCCL >= 2.19 cuMem, vLLM's measurement)",
    )
    p.add_argument(
        "--cpu-adam-rate",
        type=float,
        default=None,
        help="DeepSpeedCPUAdam parameters per second per host core, for optimizer offload (default "
        f"{DEFAULT_SETTINGS.cpu_adam_params_per_s_per_core:.2g}, measured by benchmarks/bench_cpu_adam.py; "
        "measure yours with it)",
    )
    p.add_argument(
        "--cpu-cores-per-rank",
        type=int,
        default=None,
        help=f"host cores each rank's CPU-Adam runs on (default {DEFAULT_SETTINGS.cpu_cores_per_rank})",
    )


def _add_trace_args(p: argparse.ArgumentParser) -> None:
    """Where the activation terms come from, and the output format."""
    p.add_argument(
        "--activations",
        choices=["analytic", "traced"],
        default="analytic",
        help="activation terms from formulas, or from a traced CPU run of the model's code "
        "(fake tensors, cached per shape; memfit.estimate.trace)",
    )
    p.add_argument(
        "--trace-cache",
        default=None,
        help="traced: cache directory (default $MEMFIT_TRACE_CACHE or ~/.cache/memfit/traces)",
    )
    p.add_argument(
        "--step-time-calibration",
        default=None,
        metavar="CALIBRATION_JSON",
        help="price the step time from a calibration measured on the machine (the workflow's "
        "results/<model>/<gpu>/calibration.json) instead of an assumed 40%% MFU",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")


def _load_model(name: str) -> ModelArch:
    try:
        return catalog.model(name, allow_moe=True)
    except UnicodeDecodeError:
        path = Path(name)
        path = path / "config.json" if path.is_dir() else path
        raise EstimateError(f"{path}: not UTF-8 text (expected a JSON config.json)") from None
    except (ValueError, FileNotFoundError, KeyError, OSError) as exc:
        raise EstimateError(str(exc).strip("'\"")) from None


def _from_args(args) -> tuple[ModelArch, GPU, Candidate, Settings]:
    check_flags(args)
    fill_defaults(args)
    arch = _load_model(args.model)
    context = arch.max_position_embeddings
    searched = getattr(args, "maximize", None) == "seq_len"  # fit searches up to the context
    if context and args.seq_len > context and not args.allow_beyond_context and not searched:
        raise EstimateError(
            f"--seq-len {args.seq_len} is beyond {arch.name}'s context of {context} tokens "
            "(max_position_embeddings); pass --allow-beyond-context to estimate it anyway"
        )
    try:
        gpu = catalog.gpu(args.gpu)
    except (ValueError, KeyError) as exc:
        raise EstimateError(str(exc).strip("'\"")) from None
    ref = args.ref or ("model" if args.finetune == "full" else "adapter")
    if args.method == "sft":
        ref = "precomputed" if ref == "adapter" and args.finetune == "full" else ref
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
            grad_accum=args.grad_accum,
            precision=args.precision,
            ref=ref,
            loss_impl=args.loss_impl,
            sequence_parallel=args.sequence_parallel,
            tiled_mlp=args.tiled_mlp,
            activation_offload=args.activation_offload,
        )
    except ValueError as exc:
        raise EstimateError(str(exc)) from None
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
    )
    if args.cpu_adam_rate is not None:
        settings = dataclasses.replace(settings, cpu_adam_params_per_s_per_core=args.cpu_adam_rate)
    if args.cpu_cores_per_rank is not None:
        settings = dataclasses.replace(settings, cpu_cores_per_rank=args.cpu_cores_per_rank)
    return arch, gpu, cand, settings


def _verdict_line(result: Estimate, gpu: GPU) -> str:
    why = []
    limit = result.usable_device_bytes or result.device_memory_bytes
    used = result.device_memory_bytes - result.margin_bytes
    kept = f" with {result.headroom:.0%} headroom" if result.headroom else ""
    if result.headroom and result.headroom_source != "given":
        kept += f" ({result.headroom_source})"
    if used > limit:
        why.append(f"device short by {gib(used - limit)}{kept}")
    else:
        why.append(f"device margin {gib(limit - used)}{kept}")
    if gpu.name != "cpu":
        why.append(
            f"host short by {gib(-result.host_margin_bytes)}"
            if result.host_margin_bytes < 0
            else f"host margin {gib(result.host_margin_bytes)}"
        )
    fits = result.fits_with_headroom if result.usable_device_bytes else result.fits
    return f"verdict: {'FITS' if fits else 'DOES NOT FIT'} ({', '.join(why)})"


# who loads a checkpoint at resume (Settings.trainer_loader), as the host RAM line names it
# headroom on the cpu device when none is given: what the shipped cpu configs keep (config/config.yaml);
# the derived margin is a GPU's measured error
CPU_HEADROOM = 0.10
_LOADER_WORDS = {"memfit": "memfit's trainer", "deepspeed": "DeepSpeed's own load_checkpoint"}


def render(
    result: Estimate,
    arch: ModelArch,
    gpu: GPU,
    cand: Candidate,
    num_gpus: int,
    num_nodes: int,
    method: str,
    trainer_loader: str = "memfit",
) -> str:
    """The human-readable table (`trainer_loader`: whose checkpoint load the resume phases price)."""
    lines = [
        f"{arch.name} {method} {cand.finetune} on {num_nodes}x{num_gpus} {gpu.name}  [{cand.id}]",
        f"params {result.params_total / 1e9:.3f} B total, {result.params_trainable / 1e9:.4f} B trainable",
    ]
    if result.invalid:
        lines.append(f"INVALID: {result.reason}")
        return "\n".join(lines)
    lines.append("")
    source = "; activations traced" if result.activations_source == "traced" else ""
    lines.append(f"per GPU at the peak ({result.peak_phase.replace('_', ' ')}{source}):")
    for component, size in result.breakdown.items():
        lines.append(f"  {component:<14}{gib(size):>14}")
    # the components above sum to the device total (overheads = fragmentation + CUDA context,
    # cuBLAS, NCCL); allocated and reserved are the torch counters inside it
    usable = result.usable_device_bytes or result.device_memory_bytes
    lines += [
        f"  {'-' * 28}",
        f"  {'device total':<14}{gib(result.device_total_bytes):>14}   (nvidia-smi) of "
        f"{gib(usable)} usable"
        + (f" ({gib(result.device_memory_bytes)} less {result.headroom:.0%} headroom)" if result.headroom else ""),
        f"  of which allocated {gib(result.peak_allocated_bytes)} "
        f"(torch.cuda.max_memory_allocated), reserved {gib(result.peak_reserved_bytes)} "
        "(torch.cuda.max_memory_reserved)",
        f"peak set by {result.peak_phase.replace('_', ' ')} "
        f"({result.phases[result.peak_phase] / GIB:.1f} GiB allocated); other phases: "
        + ", ".join(f"{k.replace('_', ' ')} {v / GIB:.1f}" for k, v in result.phases.items() if k != result.peak_phase)
        + " GiB",
        f"host RAM per node {gib(result.host_bytes)} of {gib(result.host_memory_bytes)}"
        f"  (peak in {(host_peak := max(result.host_phases, key=result.host_phases.get))}; other phases: "
        + ", ".join(f"{k} {v / GIB:,.1f}" for k, v in result.host_phases.items() if k != host_peak)
        + f" GiB; resume as {_LOADER_WORDS[trainer_loader]} loads)",
        f"step time {result.step_time_s:.3f} s  ({result.tokens_per_s:,.0f} tokens/s"
        + (f", MFU {result.mfu:.1%}" if result.mfu is not None else "")
        + "): "
        + ", ".join(f"{k} {v:.3f}" for k, v in result.time_breakdown.items()),
        *(
            ["compute by operation class: " + ", ".join(f"{k} {v:.3f}" for k, v in result.compute_terms.items()) + " s"]
            if result.compute_terms
            else []
        ),
        f"step time source: {result.time_source}",
        f"GPU terms calibration: {result.calibration}",
    ]
    lines += [f"note: {note}" for note in result.notes]
    lines.append(_verdict_line(result, gpu))
    return "\n".join(lines)


def _budget_bytes(args) -> int | None:
    if args.budget_gib:
        return int(args.budget_gib * GIB)
    return int(args.budget_gb * 1e9) if args.budget_gb else None


def _host_memory_gb(args) -> float | None:
    """The core takes decimal GB (the catalog's unit for host RAM)."""
    if args.host_memory_gib:
        return args.host_memory_gib * GIB / 1e9
    return args.host_memory_gb


def main(argv: list[str] | None = None) -> int:
    """`memfit estimate`: exit 0 when it fits, 1 when it does not, 2 on bad input or an
    invalid hardware combination."""
    args = _parser("memfit estimate", False).parse_args(argv)
    try:
        arch, gpu, cand, settings = _from_args(args)
        result = estimate(
            arch,
            gpu,
            args.num_gpus,
            args.num_nodes,
            args.method,
            cand,
            _host_memory_gb(args),
            _budget_bytes(args),
            settings,
            headroom=_headroom(args, gpu),
        )
    except EstimateError as exc:
        print(f"memfit estimate: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(render(result, arch, gpu, cand, args.num_gpus, args.num_nodes, args.method, settings.trainer_loader))
    if result.invalid:
        print(f"memfit estimate: invalid: {result.reason}", file=sys.stderr)
        return 2
    return 0 if result.fits_with_headroom else 1


def _headroom(args: argparse.Namespace, gpu: GPU) -> float | None:
    """The headroom asked for; None (the margin derived from memfit's measured error, said in the
    verdict) on a GPU; CPU_HEADROOM on the cpu, whose memory no GPU evidence measured."""
    if args.headroom is not None:
        return args.headroom
    return CPU_HEADROOM if gpu.name == "cpu" else None


def fit_main(argv: list[str] | None = None) -> int:
    """`memfit fit --maximize seq_len|micro_batch`: the largest value that fits; a line per search
    step on stderr (stdout holds only the answer, or only the JSON with --json)."""
    args = _parser("memfit fit", True).parse_args(argv)

    def say(line: str) -> None:
        print(f"memfit fit: {line}", file=sys.stderr, flush=True)

    try:
        arch, gpu, cand, settings = _from_args(args)
        bound, bound_by = search_bound(args, arch)
        answer = maximize(
            arch,
            gpu,
            args.num_gpus,
            args.num_nodes,
            args.method,
            cand,
            args.maximize,
            bound,
            bound_by,
            _host_memory_gb(args),
            _budget_bytes(args),
            settings,
            headroom=_headroom(args, gpu),
            say=say,
        )
    except EstimateError as exc:
        print(f"memfit fit: error: {exc}", file=sys.stderr)
        return 2
    best, result, sweep = answer.value, answer.estimate, answer.sweep
    if result is not None and result.invalid:
        print(f"memfit fit: invalid: {result.reason}", file=sys.stderr)
        if args.json:
            print(json.dumps({args.maximize: 0, **result.to_dict()}, indent=2))
        return 2
    if result is not None:
        result.notes += answer.notes
    smallest = 2 if args.maximize == "seq_len" else 1
    if args.json:
        extra = {"seq_len_by_sequence_parallel": {str(k): v for k, v in sweep.items()}} if sweep else {}
        # what stopped the search: memory, or the bound (then a larger value may fit in memory)
        extra["limited_by"] = answer.limited_by
        if answer.traced_lengths:
            extra["traced_lengths"] = answer.traced_lengths
        print(json.dumps({args.maximize: best, **extra, **(result.to_dict() if result else {})}, indent=2))
        return 0 if best > 0 else 1
    if best == 0:
        print(f"nothing fits: even {args.maximize}={smallest} needs more memory")
    else:
        used = result.headroom if result is not None else args.headroom
        kept = f" with {used:.0%} headroom" if used else ""
        stop = answer.limited_by.rsplit(": ", 1)[0]
        capped = f" (the search's bound, {stop}; not a memory limit)" if answer.limited_by != "memory" else ""
        print(f"largest {args.maximize} that fits{kept}: {best}{capped}")
    if len(sweep) > 1:
        print(
            "with Ulysses sequence parallelism (--sequence-parallel; GPUs that split each sequence): "
            + ", ".join(f"SP={sp}: {n:,}" for sp, n in sweep.items())
        )
    print()
    if result is not None:
        shown = dataclasses.replace(cand, **{args.maximize: max(best, smallest)})
        print(render(result, arch, gpu, shown, args.num_gpus, args.num_nodes, args.method, settings.trainer_loader))
    return 0 if best > 0 else 1
