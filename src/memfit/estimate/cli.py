"""`memfit estimate` and `memfit fit`: parse the flags, run the estimate, print the table or
the JSON, exit 0 (fits), 1 (does not fit) or 2 (bad input, or hardware that cannot run it).

    memfit estimate --model qwen2-7b --gpu rtx4090 --num-gpus 4 --zero 3 --seq-len 128 --json
    memfit estimate --model llama-3.1-8b --gpu a100-80gb --num-gpus 8 --zero 2,3 --micro-batch 1,2,4
    memfit fit --maximize seq_len --model glm-4-9b --gpu a100-80gb --num-gpus 8 --method dpo

The flags: memfit.estimate.cli_parser; the checks: cli_checks; the table: cli_render; what would
make it fit: advice; a ranked search space: rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path

from memfit.estimate import catalog
from memfit.estimate.advice import advise, advise_fit, default_ref, flags_between, more_gpus, needs_advice
from memfit.estimate.arch import ModelArch
from memfit.estimate.catalog import GPU
from memfit.estimate.cli_checks import (
    check_flags,
    check_space,
    combinations,
    fill_defaults,
    search_bound,
)
from memfit.estimate.cli_parser import CPU_HEADROOM, SPACE_FLAGS, given_flags, parser
from memfit.estimate.cli_render import LEGEND, advice_lines, configuration_lines, describe, render
from memfit.estimate.core import Estimate, estimate
from memfit.estimate.fit import maximize
from memfit.estimate.settings import DEFAULT_SETTINGS, EstimateError, Settings
from memfit.space import Candidate
from memfit.units import GIB, MIB

__all__ = ["CPU_HEADROOM", "LEGEND", "fit_main", "main", "render"]


def _load_model(name: str) -> ModelArch:
    try:
        return catalog.model(name, allow_moe=True)
    except UnicodeDecodeError:
        path = Path(name)
        path = path / "config.json" if path.is_dir() else path
        raise EstimateError(f"{path}: not UTF-8 text (expected a JSON config.json)") from None
    except (ValueError, FileNotFoundError, KeyError, OSError) as exc:
        raise EstimateError(str(exc).strip("'\"")) from None


def _load_gpu(name: str) -> GPU:
    try:
        return catalog.gpu(name)
    except (ValueError, KeyError) as exc:
        raise EstimateError(str(exc).strip("'\"")) from None


def _candidate(args, arch: ModelArch) -> Candidate:
    """The candidate of one combination of flags (defaults filled)."""
    context = arch.max_position_embeddings
    searched = getattr(args, "maximize", None) == "seq_len"  # fit searches up to the context
    if context and args.seq_len > context and not args.allow_beyond_context and not searched:
        raise EstimateError(
            f"--seq-len {args.seq_len} is beyond {arch.name}'s context of {context} tokens "
            "(max_position_embeddings); pass --allow-beyond-context to estimate it anyway"
        )
    ref = args.ref or default_ref(args.finetune, args.method)
    try:
        return Candidate(
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


def _settings(args) -> Settings:
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
    return settings


def _budget_bytes(args) -> int | None:
    if args.budget_gib:
        return int(args.budget_gib * GIB)
    return int(args.budget_gb * 1e9) if args.budget_gb else None


def _host_memory_gb(args) -> float | None:
    """The core takes decimal GB (the catalog's unit for host RAM)."""
    if args.host_memory_gib:
        return args.host_memory_gib * GIB / 1e9
    return args.host_memory_gb


def _headroom(args, gpu: GPU) -> float | None:
    """The headroom asked for; None (the margin derived from memfit's measured error, said in the
    verdict) on a GPU; CPU_HEADROOM on the cpu, whose memory no GPU evidence measured."""
    if args.headroom is not None:
        return args.headroom
    return CPU_HEADROOM if gpu.name == "cpu" else None


def _pricer_on(args, arch: ModelArch, gpu: GPU, settings: Settings) -> Callable[[Candidate, int, int], Estimate]:
    """The estimate of a candidate on another number of GPUs per node and nodes."""

    def price_on(cand: Candidate, num_gpus: int, num_nodes: int) -> Estimate:
        return estimate(
            arch,
            gpu,
            num_gpus,
            num_nodes,
            args.method,
            cand,
            _host_memory_gb(args),
            _budget_bytes(args),
            settings,
            headroom=_headroom(args, gpu),
        )

    return price_on


def _pricer(args, arch: ModelArch, gpu: GPU, settings: Settings) -> Callable[[Candidate], Estimate]:
    def price(cand: Candidate) -> Estimate:
        return estimate(
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

    return price


# dest -> the flag as the user types it, for "defaults taken"
_FLAG = {dest: "--" + dest.replace("_", "-") for dest in (*SPACE_FLAGS, "ref", "lora_rank")}


def _configuration(args, given: set[str], arch: ModelArch, gpu: GPU, cand: Candidate, settings: Settings) -> dict:
    """The configuration priced, for the table and `--json`: every lever, the defaults taken, and
    where the host RAM and the device memory came from."""
    if args.host_memory_gib is not None or args.host_memory_gb is not None:
        flag = "--host-memory-gib" if args.host_memory_gib is not None else "--host-memory-gb"
        host_gb, source = _host_memory_gb(args), f"given ({flag})"
    else:
        host_gb = gpu.typical_host_memory_gb
        source = (
            f"the catalog's typical {gpu.name} node ({gpu.typical_host_memory_gb:g} GB; --host-memory-gib sets yours)"
        )
    defaults = {}
    for dest in ("finetune", "zero", "grad_ckpt", "attn", "loss_impl", "precision", "micro_batch", "seq_len"):
        if dest not in given and not (dest == getattr(args, "maximize", None)):
            value = getattr(cand, dest)
            defaults[_FLAG[dest]] = ("on" if value else "off") if dest == "grad_ckpt" else value
    if args.method == "dpo" and "ref" not in given:
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
        "device_memory": "given (--budget-gib/--budget-gb)" if _budget_bytes(args) else f"the {gpu.name}'s",
    }


def _progress(say: Callable[[str], None] | None):
    """While inside, a model being traced reports each traced shape to `say` (the tracer's
    memfit.estimate.trace.progress_to; nothing where the tracer has no such hook)."""
    from memfit.estimate import trace

    hook = getattr(trace, "progress_to", None)
    return hook(say) if hook is not None and say is not None else contextlib.nullcontext()


def _advice_on(args, result: Estimate) -> bool:
    """--advice, or by default unless the model is traced (where each lever traces again)."""
    if args.advice is not None:
        return args.advice
    return result.activations_source != "traced"


def _prepare(args, prog: str, argv: list[str] | None, fit: bool):
    """The parsed flags as (combinations, arch, gpu, settings, given)."""
    given = given_flags(prog, fit, list(sys.argv[1:] if argv is None else argv))
    combos = combinations(args, SPACE_FLAGS)
    if fit and len(combos) > 1:
        many = [_FLAG[d] for d in SPACE_FLAGS if getattr(args, d) and len(getattr(args, d)) > 1]
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
    arch, gpu = _load_model(args.model), _load_gpu(args.gpu)
    return combos, arch, gpu, _settings(combos[0]), given


def _say(prog: str) -> Callable[[str], None]:
    def say(line: str) -> None:
        print(f"{prog}: {line}", file=sys.stderr, flush=True)

    return say


def main(argv: list[str] | None = None) -> int:
    """`memfit estimate`: exit 0 when it fits, 1 when it does not, 2 on bad input or an
    invalid hardware combination."""
    args = parser("memfit estimate", False).parse_args(argv)
    try:
        combos, arch, gpu, settings, given = _prepare(args, "memfit estimate", argv, False)
        price = _pricer(combos[0], arch, gpu, settings)
        traced = arch.generic or settings.activations == "traced"
        say = None if (args.json or args.quiet or not traced) else _say("memfit estimate")
        if len(combos) > 1:
            with _progress(say):
                return _rank_main(combos, arch, gpu, settings, given, price)
        one = combos[0]
        cand = _candidate(one, arch)
        config = _configuration(one, given, arch, gpu, cand, settings)
        options = []
        hardware = None
        with _progress(say):
            result = price(cand)
            if needs_advice(result) and _advice_on(one, result):
                world = one.num_gpus * one.num_nodes
                options = advise(price, cand, result, arch, world, one.method, "ref" in given)
                if not result.fits_with_headroom and gpu.name != "cpu":
                    hardware = more_gpus(
                        _pricer_on(one, arch, gpu, settings),
                        cand,
                        one.num_gpus,
                        one.num_nodes,
                        gpu.typical_gpus_per_node,
                    )
    except EstimateError as exc:
        print(f"memfit estimate: error: {exc}", file=sys.stderr)
        return 2
    fits = result.fits_with_headroom
    if args.json:
        extra = {"advice": [o.to_dict(result) for o in options]} if needs_advice(result) else {}
        if hardware is not None:
            extra["more_gpus"] = hardware.to_dict(result)
        print(json.dumps({**result.to_dict(), "configuration": config, **extra}, indent=2))
    else:
        table = render(result, arch, gpu, cand, one.num_gpus, one.num_nodes, one.method, one.trainer_loader, True)
        title, rest = table.split("\n", 1)
        print("\n".join([title, *configuration_lines(config), rest]))
        if needs_advice(result) and _advice_on(one, result):
            print("\n".join(advice_lines(options, result, fits, hardware=hardware)))
        elif needs_advice(result):
            print("advice: off for a traced model (each lever traces again); --advice computes it")
    if result.invalid:
        print(f"memfit estimate: invalid: {result.reason}", file=sys.stderr)
        return 2
    return 0 if fits else 1


def _rank_main(combos, arch: ModelArch, gpu: GPU, settings: Settings, given: set[str], price) -> int:
    """Every combination estimated, then ranked by the workflow's selection (memfit.estimate.rank)."""
    from memfit.estimate.rank import rank, render_ranking

    first = combos[0]
    priced, skipped, seen, flags = [], {}, set(), {}
    listed = [d for d in SPACE_FLAGS if len({repr(getattr(one, d)) for one in combos}) > 1]
    for one in combos:
        try:
            cand = _candidate(one, arch)
        except EstimateError as exc:  # a combination DeepSpeed cannot run, as the workflow skips it
            skipped.setdefault(str(exc), []).append(describe_flags(one, listed))
            continue
        if cand.id not in seen:
            seen.add(cand.id)
            priced.append((cand, price(cand)))
            flags[cand.id] = describe_flags(one, listed)
    if not priced:
        raise EstimateError(f"no combination of the lists can run: {next(iter(skipped))}")
    ranking = rank(priced, first.num_gpus * first.num_nodes, first.method)
    for why, which in skipped.items():
        more = f" and {len(which) - 1} more" if len(which) > 1 else ""
        ranking.skipped.append(f"{which[0]}{more}: {why}")
    if first.json:
        config = _configuration(first, given, arch, gpu, priced[0][0], settings)
        config = {k: v for k, v in config.items() if k not in ("candidate", "words")}
        print(json.dumps({**ranking.to_dict(), "configuration": config}, indent=2))
    else:
        title = (
            f"{arch.name} {first.method} on {first.num_nodes}x{first.num_gpus} {gpu.name}: {len(priced)} "
            f"configurations, each at --grad-accum {first.grad_accum} (a larger micro batch trains a larger "
            "global batch)"
        )
        print(render_ranking(ranking, title, flags))
    if all(est.invalid for _, est in priced):
        print(f"memfit estimate: invalid: every combination: {priced[0][1].reason}", file=sys.stderr)
        return 2
    return 0 if ranking.selected is not None else 1


def describe_flags(args, dests) -> str:
    """One combination of the listed levers (`dests`), as the flags that price it alone."""
    words = []
    for dest in dests:
        value = getattr(args, dest)
        words.append(f"{_FLAG[dest]} {('on' if value else 'off') if dest == 'grad_ckpt' else value}")
    return " ".join(words)


def fit_main(argv: list[str] | None = None) -> int:
    """`memfit fit --maximize seq_len|micro_batch`: the largest value that fits; a line per search
    step on stderr (stdout holds only the answer, or only the JSON with --json)."""
    args = parser("memfit fit", True).parse_args(argv)

    say = (lambda line: None) if args.quiet else _say("memfit fit")
    try:
        combos, arch, gpu, settings, given = _prepare(args, "memfit fit", argv, True)
        args = combos[0]
        cand = _candidate(args, arch)
        config = _configuration(args, given, arch, gpu, cand, settings)
        bound, bound_by = search_bound(args, arch)

        def search(c: Candidate, quiet: bool = False, sweep: bool = True):
            return maximize(
                arch,
                gpu,
                args.num_gpus,
                args.num_nodes,
                args.method,
                c,
                args.maximize,
                bound,
                bound_by,
                _host_memory_gb(args),
                _budget_bytes(args),
                settings,
                headroom=_headroom(args, gpu),
                say=(lambda line: None) if quiet else say,
                sweep=sweep,
            )

        answer = search(cand)
        options = []
        est = answer.estimate
        if est is not None and not est.invalid and answer.limited_by == "memory" and _advice_on(args, est):

            def lever(c: Candidate):
                say(f"advice: the largest {args.maximize} with {flags_between(cand, c)}")
                got = search(c, quiet=True, sweep=False)
                return got.value, got.estimate

            world = args.num_gpus * args.num_nodes
            options = advise_fit(lever, cand, args.maximize, answer.value, arch, world, args.method, "ref" in given)
    except EstimateError as exc:
        print(f"memfit fit: error: {exc}", file=sys.stderr)
        return 2
    return _fit_output(args, answer, options, config, arch, gpu, cand, settings)


def _fit_output(args, answer, options, config, arch, gpu, cand, settings) -> int:
    best, result, sweep = answer.value, answer.estimate, answer.sweep
    if result is not None and result.invalid:
        print(f"memfit fit: invalid: {result.reason}", file=sys.stderr)
        if args.json:
            print(json.dumps({args.maximize: 0, **result.to_dict(), "configuration": config}, indent=2))
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
        extra["advice"] = [o.to_dict(result) for o in options]
        extra["configuration"] = config
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
    if options or (result is not None and answer.limited_by == "memory" and _advice_on(args, result)):
        print("\n".join(advice_lines(options, result, best > 0, args.maximize)))
    if len(sweep) > 1:
        print(
            "with Ulysses sequence parallelism (--sequence-parallel; GPUs that split each sequence): "
            + ", ".join(f"SP={sp}: {n:,}" for sp, n in sweep.items())
        )
    print()
    if result is not None:
        shown = dataclasses.replace(cand, **{args.maximize: max(best, smallest)})
        table = render(
            result, arch, gpu, shown, args.num_gpus, args.num_nodes, args.method, settings.trainer_loader, True
        )
        title, rest = table.split("\n", 1)
        config = {**config, "words": describe(shown, args.method, settings.lora_targets)}
        print("\n".join([title, *configuration_lines(config), rest]))
    return 0 if best > 0 else 1
