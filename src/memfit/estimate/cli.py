"""`memfit estimate` and `memfit fit`: parse the flags, run the estimate, print the table or
the JSON, exit 0 (fits), 1 (does not fit) or 2 (bad input, or hardware that cannot run it).

    memfit estimate --model qwen2-7b --gpu rtx4090 --num-gpus 4 --zero 3 --seq-len 128 --json
    memfit estimate --model llama-3.1-8b --gpu a100-80gb --num-gpus 8 --zero 2,3 --micro-batch 1,2,4
    memfit fit --maximize seq_len --model glm-4-9b --gpu a100-80gb --num-gpus 8 --method dpo

The flags: memfit.estimate.cli_parser; their checks: cli_checks; from flags to estimates:
cli_setup; the table: cli_render; what would make it fit: advice; a ranked search space: rank;
`memfit fit`: cli_fit.
"""

from __future__ import annotations

import json
import sys

from memfit.estimate.advice import advise, more_gpus, needs_advice
from memfit.estimate.cli_fit import fit_main
from memfit.estimate.cli_parser import SPACE_FLAGS, parser
from memfit.estimate.cli_render import LEGEND, advice_lines, configuration_lines, render
from memfit.estimate.cli_settings_flags import CPU_HEADROOM
from memfit.estimate.cli_setup import (
    FLAG,
    advice_on,
    candidate_of,
    configuration,
    prepare,
    pricer,
    pricer_on,
    progress,
    say_to,
    sigterm_unwinds,
)
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.models.catalog import GPU
from memfit.estimate.settings import EstimateError, Settings

__all__ = ["CPU_HEADROOM", "LEGEND", "fit_main", "main", "render"]


@sigterm_unwinds
def main(argv: list[str] | None = None) -> int:
    """`memfit estimate`: exit 0 when it fits, 1 when it does not, 2 on bad input or an
    invalid hardware combination."""
    args = parser("memfit estimate", False).parse_args(argv)
    try:
        combos, arch, gpu, settings, given = prepare(args, "memfit estimate", argv, False)
        price = pricer(combos[0], arch, gpu, settings)
        traced = arch.generic or settings.activations == "traced"
        say = None if (args.json or args.quiet or not traced) else say_to("memfit estimate")
        if len(combos) > 1:
            with progress(say):
                return _rank_main(combos, arch, gpu, settings, given, price)
        one = combos[0]
        cand = candidate_of(one, arch)
        config = configuration(one, given, arch, gpu, cand, settings)
        options = []
        hardware = None
        with progress(say):
            result = price(cand)
            if needs_advice(result) and advice_on(one, result):
                world = one.num_gpus * one.num_nodes
                options = advise(price, cand, result, arch, world, one.method, "ref" in given)
                if not result.fits_with_headroom and gpu.name != "cpu":
                    hardware = more_gpus(
                        pricer_on(one, arch, gpu, settings),
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
        if needs_advice(result) and advice_on(one, result):
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
            cand = candidate_of(one, arch)
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
        config = configuration(first, given, arch, gpu, priced[0][0], settings)
        config = {k: v for k, v in config.items() if k not in ("candidate", "words")}
        print(json.dumps({**ranking.to_dict(), "configuration": config}, indent=2))
    else:
        title = f"{arch.name} {first.method} on {first.num_nodes}x{first.num_gpus} {gpu.name}: {len(priced)} " + (
            f"configurations, each training a global batch of {first.global_batch}"
            if first.global_batch
            else f"configurations, each at --grad-accum {first.grad_accum} (a larger micro batch trains a "
            "larger global batch; --global-batch holds it fixed)"
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
        words.append(f"{FLAG[dest]} {('on' if value else 'off') if isinstance(value, bool) else value}")
    return " ".join(words)
