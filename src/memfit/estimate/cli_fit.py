"""`memfit fit --maximize seq_len|micro_batch`: the largest value that fits, a line per search step
on stderr, and how far each of memfit's levers would take it (memfit.estimate.advice.advise_fit)."""

from __future__ import annotations

import dataclasses
import json
import sys

from memfit.estimate.advice import advise_fit, flags_between
from memfit.estimate.cli_checks import search_bound
from memfit.estimate.cli_parser import parser
from memfit.estimate.cli_render import advice_lines, configuration_lines, describe, render
from memfit.estimate.cli_setup import (
    advice_on,
    budget_bytes,
    candidate_of,
    configuration,
    headroom_of,
    host_memory_gb,
    prepare,
    say_to,
    sigterm_unwinds,
)
from memfit.estimate.fit import maximize
from memfit.estimate.settings import EstimateError
from memfit.methods import shape as method_shape
from memfit.space import Candidate


@sigterm_unwinds
def fit_main(argv: list[str] | None = None) -> int:
    """`memfit fit --maximize seq_len|micro_batch`: the largest value that fits; a line per search
    step on stderr (stdout holds only the answer, or only the JSON with --json)."""
    args = parser("memfit fit", True).parse_args(argv)

    say = (lambda line: None) if args.quiet else say_to("memfit fit")
    try:
        combos, arch, gpu, settings, given = prepare(args, "memfit fit", argv, True)
        args = combos[0]
        cand = candidate_of(args, arch)
        config = configuration(args, given, arch, gpu, cand, settings)
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
                host_memory_gb(args),
                budget_bytes(args),
                settings,
                headroom=headroom_of(args, gpu),
                say=(lambda line: None) if quiet else say,
                sweep=sweep,
            )

        answer = search(cand)
        options = []
        est = answer.estimate
        if est is not None and not est.invalid and answer.limited_by == "memory" and advice_on(args, est):

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
    smallest = 2 if args.maximize == "seq_len" else method_shape(args.method).min_micro_batch
    shown = dataclasses.replace(cand, **{args.maximize: max(best, smallest)})  # the answer's configuration
    config = {**config, "candidate": shown.to_dict(), "words": describe(shown, args.method, settings.lora_targets)}
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
    if options or (result is not None and answer.limited_by == "memory" and advice_on(args, result)):
        print("\n".join(advice_lines(options, result, best > 0, args.maximize)))
    if len(sweep) > 1:
        print(
            "with Ulysses sequence parallelism (--sequence-parallel; GPUs that split each sequence): "
            + ", ".join(f"SP={sp}: {n:,}" for sp, n in sweep.items())
        )
    print()
    if result is not None:
        table = render(
            result, arch, gpu, shown, args.num_gpus, args.num_nodes, args.method, settings.trainer_loader, True
        )
        title, rest = table.split("\n", 1)
        print("\n".join([title, *configuration_lines(config), rest]))
    return 0 if best > 0 else 1
