"""Ulysses sequence parallelism on the CPU: probed peaks with SP=1 and SP=2 against the estimate.

    .venv/bin/python benchmarks/bench_sequence_parallel.py [--out FILE]

The demo model (config/models/demo-tiny.json) and data under benchmarks/results/.work/qlora
(made once), full fine-tune in fp32, micro batch 4 of 128 tokens, grad_accum 1, sdpa; each shape
probed by `memfit.workflow.probe.run_probe` on 2 CPU ranks (2 steps on the worst-case batch, peak
allocated bytes per rank from `memfit.train.memory.AllocationTracker`) and estimated by
`memfit.estimate.estimate` for the same candidate on `cpu`. Printed per shape: measured and
predicted peak and their error; per pair, what SP=2 saved. docs/long-context.md quotes a run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_qlora_memory import REPO, build, probe_candidate  # noqa: E402

WORLD = 2
SHAPES = [(method, zero, sp) for method in ("sft", "dpo") for zero in (2, 3) for sp in (1, 2)]


def measure(root: Path, method: str, zero: int, sp: int) -> dict:
    from memfit.space import Candidate

    cand = Candidate(
        zero=zero, precision="fp32", finetune="full", micro_batch=4, grad_accum=1, seq_len=128, attn="sdpa",
        sequence_parallel=sp, ref="model",
    )  # fmt: skip
    name = f"{method}-z{zero}-sp{sp}"
    res, est = probe_candidate(root, method, cand, root / "sequence-parallel", name, steps=2)
    return {
        "name": name,
        "candidate": cand.to_dict(),
        "measured_peak_bytes": res["peak_allocated_bytes"],
        "predicted_peak_bytes": est.peak_allocated_bytes,
        "predicted_activation_bytes": est.breakdown["activations"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    ap.add_argument("--work", type=Path, default=REPO / "benchmarks/results/.work/qlora")
    args = ap.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    root = build(args.work)
    t0 = time.perf_counter()
    rows = [measure(root, *s) for s in SHAPES]
    print(f"{'shape':12s} {'measured':>12s} {'predicted':>12s} {'error':>7s}")
    for r in rows:
        m, p = r["measured_peak_bytes"], r["predicted_peak_bytes"]
        print(f"{r['name']:12s} {m:12,d} {p:12,d} {p / m - 1:+7.1%}")
    by = {r["name"]: r for r in rows}
    for method, zero, _ in SHAPES[::2]:
        one, two = by[f"{method}-z{zero}-sp1"], by[f"{method}-z{zero}-sp2"]
        saved = one["measured_peak_bytes"] - two["measured_peak_bytes"]
        predicted = one["predicted_peak_bytes"] - two["predicted_peak_bytes"]
        print(f"{method}-z{zero}: SP=2 saves {saved:,d} B per rank measured, {predicted:,d} B predicted")
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.out:
        args.out.write_text(json.dumps({"world_size": WORLD, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
