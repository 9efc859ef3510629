"""Every model type of transformers' causal-LM mapping: a tiny random model of it (its own
defaults, shrunk: memfit.estimate.coverage.tiny_config), memfit's estimate, and one real CPU
training step measured with memfit's AllocationTracker (two steps, fp32, ZeRO-0, AdamW, SFT loss,
micro batch 2 x 64 tokens), full fine-tuning and LoRA.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_coverage.py [--finetune full lora]
        [--only llama gpt2 ...] [--json benchmarks/results/coverage.json]
        [--markdown docs/coverage-table.md]

Prints one line per type and finetune (parameters exact?, predicted and measured peak, error, or
why it was not estimated / measured) and the summary the issue sets bars on: types estimated (of
all), parameters exact for all of those, peak within 5% of measured for at least 90%. About
5-15 s per type and finetune on 2 cores (the first run traces; traces and inventories are
cached in a temporary folder), so about an hour for both finetunes. Exits 1 when a bar is
missed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src")]

from memfit.estimate.coverage import Row, causal_lm_types, coverage_row  # noqa: E402

BARS = {"estimated": 150, "within_5pct": 0.90}  # issue 21's bars


def summary(rows: list[Row]) -> dict[str, object]:
    estimated = [r for r in rows if r.predicted]
    measured = [r for r in estimated if r.measured]
    within = [r for r in measured if r.error is not None and abs(r.error) <= 0.05]
    return {
        "rows": len(rows),
        "estimated": len(estimated),
        "params_exact": sum(1 for r in estimated if r.params_exact),
        "measured": len(measured),
        "within_5pct": len(within),
        "share_within_5pct": len(within) / len(measured) if measured else 0.0,
    }


def markdown(rows: list[Row]) -> str:
    lines = [
        "| model_type | finetune | params exact | params | predicted MiB | measured MiB | error | note |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        err = f"{r.error:+.1%}" if r.error is not None else ""
        pred = f"{r.predicted / 2**20:.2f}" if r.predicted else ""
        meas = f"{r.measured / 2**20:.2f}" if r.measured else ""
        exact = {True: "yes", False: "**no**", None: ""}[r.params_exact]
        note = r.reason.replace("|", "/")[:160]
        lines.append(f"| {r.model_type} | {r.finetune} | {exact} | {r.params:,} | {pred} | {meas} | {err} | {note} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--finetune", nargs="+", default=["full", "lora"], choices=("full", "lora"))
    ap.add_argument("--only", nargs="+", help="model types (default: every causal-LM type)")
    ap.add_argument("--json", type=Path, help="write the rows and the summary here")
    ap.add_argument("--markdown", type=Path, help="write the table as Markdown here")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ["MEMFIT_TRACE_IN_PROCESS"] = "1"  # a tiny model's trace is shorter than a child's start-up
    import transformers

    transformers.logging.set_verbosity_error()
    cache = tempfile.mkdtemp(prefix="memfit-coverage-")
    types = a.only or causal_lm_types()
    rows: list[Row] = []
    for ft in a.finetune:
        for mt in types:
            r = coverage_row(mt, ft, trace_cache=cache)
            rows.append(r)
            err = f"{r.error:+6.1%}" if r.error is not None else "     -"
            print(
                f"{mt:28} {ft:4} exact={r.params_exact!s:5} predicted {r.predicted / 2**20:8.2f} MiB "
                f"measured {r.measured / 2**20:8.2f} MiB {err} {r.seconds:5.1f} s {r.reason[:120]}",
                flush=True,
            )
    s = summary(rows)
    per_ft = {ft: summary([r for r in rows if r.finetune == ft]) for ft in a.finetune}
    print(json.dumps({"all": s, **per_ft}, indent=1))
    if a.json:
        a.json.write_text(json.dumps({"summary": {"all": s, **per_ft}, "rows": [r.to_json() for r in rows]}, indent=1))
    if a.markdown:
        a.markdown.write_text(markdown(rows))
    ok = all(
        v["estimated"] >= BARS["estimated"] * (len(types) / len(causal_lm_types()))
        and v["params_exact"] == v["estimated"]
        and v["share_within_5pct"] >= BARS["within_5pct"]
        for v in per_ft.values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
