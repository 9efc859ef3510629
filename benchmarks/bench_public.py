"""memfit's estimate against published, measured GPU memory of fine-tuning runs.

    .venv/bin/python benchmarks/bench_public.py [--table tests/public_measurements.yaml]
        [--no-terms] [--no-maxfit]

Prints, per row of the table (sources and settings in the YAML): the published figure, the
estimator's matching figure (max_memory_allocated -> peak allocated, reserved -> peak reserved,
nvidia-smi and max-fit -> device total), the error (negative: memfit predicts less than was
measured, a user following it can OOM), the phase that holds the peak and the component that
dominates it. Then the median and worst error, the direction, the rows more than 5% low
without an `explained:` note, the longest sequence memfit says fits for the max-fit rows, and
the out-of-memory rows. Then (unless --no-terms) the bytes each term added for issue #16 brings
to every row's figure: another trainer's held logits (Settings.logits_handling, from the row's
loss_impl), the fp32 logits block the caching allocator keeps (overheads.cached_logits_block),
NCCL's cuMem communicator (overheads.NCCL_CUMEM_BYTES) and its NVLS buffers on NVSwitch nodes
(overheads.nvls_bytes); sources in their docstrings. Rows with a rounded figure (published_rounding)
or an upper bound (bound: upper, every max-fit row) also print their error against that
interval (`vs range`), which is what decides whether such a row is more than 5% low.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from memfit_validation import memory as v

from memfit.units import GIB


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--table", type=Path, default=v.TABLE)
    p.add_argument("--no-terms", action="store_true", help="skip the per-term table")
    p.add_argument("--no-maxfit", action="store_true", help="skip the max-fit bisection")
    args = p.parse_args(argv)

    rows, ooms = v.load_table(args.table)
    results = [v.compare(r) for r in rows]
    print("\n".join(v.table_lines(results)))
    s = v.summarize(results)
    print()
    print("now:", s.line())
    if s.low_unexplained:
        print("  > 5% low, unexplained:", ", ".join(s.low_unexplained))
    print(
        f"  targets (issue #16): median <= {v.TARGET_MEDIAN:.0%}, none > 5% low unexplained:",
        "met" if s.meets_targets else "NOT met",
    )

    if not args.no_maxfit:
        print("\nmax-fit rows: the longest sequence memfit says fits vs the published one")
        for r in rows:
            if r.measured == "max-fit":
                pred = v.max_fitting_seq_len(r)
                n = r.cand.seq_len
                print(f"  {r.id:46} published {n:>7,}  memfit {pred:>7,} ({pred / n - 1:+.0%})")

    print("\nout-of-memory rows (memfit must not fit them):")
    for r in ooms:
        e = v.predict(r)
        verdict = "ok (does not fit)" if not e.fits else "WRONG (memfit says it fits)"
        print(
            f"  {r.id:46} memfit {e.device_total_bytes / GIB:7.2f} GiB of "
            f"{e.device_memory_bytes / GIB:.2f} GiB: {verdict}"
        )

    if not args.no_terms:
        print("\nissue #16's terms in each row's figure (GiB):")
        names = (
            "held_logits", "logits_block", "nccl", "nvls", "qlora_dequant", "z3_gathered",
            "reduce_bucket",
        )  # fmt: skip
        print(f"  {'id':46} {'error':>7}  " + "  ".join(f"{n:>13}" for n in names))
        for r in results:
            terms = v.issue16_terms(r)
            cols = "  ".join(f"{terms[n] / GIB:13.2f}" for n in names)
            print(f"  {r.row.id:46} {r.error:+7.1%}  {cols}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
