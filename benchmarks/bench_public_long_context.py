"""memfit's longest sequence against DeepSpeed ALST's published ones (tests/public_long_context.yaml).

    .venv/bin/python benchmarks/bench_public_long_context.py [--out FILE]

Prints per row: GPUs, levers, the published length, memfit's (`memfit fit --maximize seq_len`),
the error and the phase that bounds it; then the median and worst |error| and, per sweep, how
many pairs memfit orders as published. The README quotes a run. Seconds on a laptop.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def levers(cand) -> str:
    out = [f"SP={cand.sequence_parallel}"] if cand.sequence_parallel > 1 else []
    out += ["chunked loss"] if cand.loss_impl == "chunked" else []
    out += ["tiled MLP"] if cand.tiled_mlp else []
    out += ["act. offload"] if cand.activation_offload else []
    out += ["param offload"] if cand.offload_param != "none" else []
    out += [cand.attn] if cand.attn != "flash" else []
    return ", ".join(out) or "baseline"


def main(argv: list[str] | None = None) -> int:
    from memfit_validation.long_context import compare, load_table, order_agreement, summary

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", type=Path, default=REPO / "tests/public_long_context.yaml")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    results = compare(load_table(args.table))
    print(
        f"{'row':28s} {'GPUs':>4s}  {'levers (ZeRO-3, optimizer offload, checkpointing)':52s} {'published':>11s} {'memfit':>11s} {'error':>7s}"
    )
    for r in results:
        gpus = r.row.gpus * r.row.nodes
        print(
            f"{r.row.id:28s} {gpus:4d}  {levers(r.row.cand):52s} {r.row.published:11,d} {r.predicted:11,d} {r.error:+7.1%}"
        )
    s = summary(results)
    print(f"\n{s['rows']} rows: median |error| {s['median_abs_error']:.1%}, worst {s['worst_abs_error']:.1%}")
    for sweep, (agree, pairs) in order_agreement(results).items():
        print(f"sweep {sweep}: {agree} of {pairs} pairs in the published order")
    if args.out:
        rows = [
            {"id": r.row.id, "published": r.row.published, "predicted": r.predicted, "error": r.error} for r in results
        ]
        args.out.write_text(json.dumps({"summary": s, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
