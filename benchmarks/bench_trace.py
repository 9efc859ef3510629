"""The traced activation path's sweeps (memfit.estimate.trace.trace), every case: what tests/test_trace.py checks
on representative cases, over all of them.

1. fake-tensor trace == the same step on real tensors, and affine in the micro batch (2, 3, 4
   sequences): Llama/Qwen2 x sdpa/eager x checkpointing x full/LoRA cases (`FAKE_CASES`);
2. traced and analytic estimates against the real-tensor ground truth (memory.AllocationTracker
   over two optimizer steps; tests/test_estimate_groundtruth.py) within 5% (`GT_CASES`);
3. traced vs analytic activation terms of catalog models at real sizes (bf16, 2048 tokens),
   within 2%.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_trace.py [--only fake|groundtruth|catalog]

Exits 1 when a case is outside the bound the test uses. A few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO / "tests")]

from test_trace import (  # noqa: E402
    FAKE_CASES,
    GT_CASES,
    catalog_disagreements,
    fake_vs_real,
    groundtruth_rows,
)

CATALOG = ("llama-3.1-8b", "qwen2.5-7b")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("fake", "groundtruth", "catalog"))
    a = ap.parse_args(argv)
    cache = Path(tempfile.mkdtemp(prefix="memfit-traces-"))
    bad: list[str] = []
    if a.only in (None, "fake"):
        failures = fake_vs_real(FAKE_CASES)
        print(f"fake vs real, {len(FAKE_CASES)} cases: {len(failures)} failing")
        bad += failures
    if a.only in (None, "groundtruth"):
        for kind, method, c, m, an, tr in groundtruth_rows(GT_CASES, cache):
            ea, et = (an.peak_allocated_bytes - m) / m, (tr.peak_allocated_bytes - m) / m
            print(f"{kind:6} {method} {c.id:60} measured {m:>10} analytic {ea:+6.1%} traced {et:+6.1%}")
            if abs(et) > 0.05:
                bad.append(f"{kind} {method} {c.id}: traced {et:+.1%} of the measured peak")
            if abs(tr.peak_allocated_bytes - an.peak_allocated_bytes) > 0.05 * an.peak_allocated_bytes:
                bad.append(f"{kind} {method} {c.id}: traced and analytic differ by more than 5%")
    if a.only in (None, "catalog"):
        for name in CATALOG:
            failures = catalog_disagreements(name, cache)
            print(f"{name}: traced vs analytic terms, {len(failures)} over 2%")
            bad += failures
    print("\n".join(bad) if bad else "every case within its bound")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
