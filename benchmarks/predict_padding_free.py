"""What the estimator predicts for benchmarks/bench_padding_free.py's cases, against what it measured
(issue #45: padded and padding-free candidates priced on the same data).

For each full fine-tuning case of the results file (--results): the case's rows again (the same
seed: `synthetic_rows`, or the demo's rows prepared as the benchmark prepares them), the length
statistics prepare_data would write for them (memfit.data.preparation `_length_stats` over each
row's `length`: SFT the row, a pair the prompt and the longer response), and the estimate of the
padded and the padding-free candidate (config/models/demo-tiny.json, gpu cpu, uncalibrated, 1 rank,
ZeRO-0, fp32, full, sdpa, no checkpointing, micro batch --batch, DPO with a reference model;
seq_len L for uL/*, 32 for the demo, 512 for heavy) with the statistics the workflow passes
(memfit.workflow.pipeline: `length.mean` and `length.quantiles`) and, as before them, the mean only.
The predicted gain is the padded step over the padding-free one; the measured one is the results'
`gain` (padding-free tokens/s over padded). Also: the expected longest row of a micro batch the
estimate prices, and the mean longest row of the batches the benchmark measured (its own draw).

Output: a table on stdout and benchmarks/results/padding_free_predicted.json (--out).

Usage: .venv/bin/python benchmarks/predict_padding_free.py     # seconds; the demo model's tokenizer is built
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_padding_free beside this file

from bench_padding_free import REPO, synthetic_rows  # noqa: E402

from memfit.data.preparation import _length_stats  # noqa: E402
from memfit.estimate import Settings, estimate  # noqa: E402
from memfit.estimate.models import catalog  # noqa: E402
from memfit.estimate.time.data_scale import expected_longest  # noqa: E402
from memfit.space import Candidate  # noqa: E402


def row_length(method: str, row: dict) -> int:
    """prepare_data's `length` column (memfit.data.preparation): SFT the row's tokens, a pair the
    prompt and the longer response."""
    if method == "sft":
        return len(row["input_ids"])
    return len(row["prompt_ids"]) + max(len(row["chosen_ids"]), len(row["rejected_ids"]))


def case_seq_len(case: str) -> int:
    return 32 if case == "demo" else 512 if case == "heavy" else int(case[1:].split("/")[0])


def predicted_gain(method: str, rows: list[dict], seq_len: int, micro_batch: int, quantiles: bool = True) -> float:
    """The estimate's padded step time over its padding-free one, with the rows' stats.json
    statistics as the workflow passes them (`quantiles` False: the mean only, as before issue #45)."""
    stats = _length_stats(np.array([row_length(method, r) for r in rows]))
    settings = Settings(row_tokens=stats["mean"], row_length_quantiles=tuple(stats["quantiles"]) if quantiles else None)
    arch, gpu = catalog.model(str(REPO / "config/models/demo-tiny.json")), catalog.gpu("cpu")
    ref = "model" if method == "dpo" else None
    step = {
        pf: estimate(
            arch,
            gpu,
            1,
            1,
            method,
            Candidate(
                zero=0,
                attn="sdpa",
                precision="fp32",
                finetune="full",
                micro_batch=micro_batch,
                seq_len=seq_len,
                padding_free=pf,
                ref=ref,
            ),
            settings=settings,
        ).step_time_s  # fmt: skip
        for pf in (False, True)
    }
    return step[False] / step[True]


def case_rows(method: str, case: str, n: int, seed: int, demo_dir: Path | None) -> list[dict]:
    """The rows bench_padding_free.py ran the case on (its `synthetic_rows`, or the demo's train split)."""
    if case != "demo":
        return synthetic_rows(method, case, n, 32000, seed)  # lengths are drawn before the ids: any vocabulary
    from memfit import data

    assert demo_dir is not None
    return data.load_split(demo_dir / method, "train")[:n]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=REPO / "benchmarks/results/padding_free_cpu.json")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/padding_free_predicted.json")
    a = p.parse_args()
    measured = json.loads(a.results.read_text())
    s = measured["settings"]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        results = [r for r in measured["results"] if r["finetune"] == "full"]
        if any(r["case"] == "demo" for r in results):
            from memfit import data
            from memfit.workflow.demo import build_demo_model

            build_demo_model(REPO / "config/models/demo-tiny.json", REPO / "data/demo", tmp / "demo-tiny")
            for m in {r["method"] for r in results}:  # as bench_padding_free.py prepares them
                data.prepare(
                    m, REPO / f"data/demo/{m}.jsonl", tmp / "demo-tiny", tmp / m, max_len=64, eval_fraction=0.05
                )
        for r in results:
            m, c, mb = r["method"], r["case"], s["batch"]
            rows = case_rows(m, c, s["rows"], s["seed"], tmp)
            brng = random.Random(f"{s['seed']}-{m}-{c}-batches")  # the batches the benchmark measured
            batches = [brng.sample(rows, mb) for _ in range(s["batches"])]
            stats = _length_stats(np.array([row_length(m, x) for x in rows]))
            L = case_seq_len(c)
            row = {
                "method": m,
                "case": c,
                "seq_len": L,
                "row_mean": stats["mean"],
                "expected_longest": round(min(expected_longest(stats["quantiles"], mb), L), 1),
                "measured_batches_longest": round(
                    float(np.mean([max(row_length(m, x) for x in b) for b in batches])), 1
                ),
                "predicted_gain_mean_only": round(predicted_gain(m, rows, L, mb, quantiles=False), 3),
                "predicted_gain": round(predicted_gain(m, rows, L, mb), 3),
                "measured_gain": r["gain"],
            }
            row["agrees"] = (row["predicted_gain"] > 1) == (row["measured_gain"] > 1)
            out.append(row)
    print(
        f"{'method':6} {'case':7} {'L':>4} {'mean':>6} {'E[max]':>7} {'batches':>7} {'before':>6} {'now':>6} {'measured':>8} agrees"
    )
    for x in out:
        print(
            f"{x['method']:6} {x['case']:7} {x['seq_len']:>4} {x['row_mean']:>6.1f} {x['expected_longest']:>7.1f} "
            f"{x['measured_batches_longest']:>7.1f} {x['predicted_gain_mean_only']:>6.2f} {x['predicted_gain']:>6.2f} "
            f"{x['measured_gain']:>8.2f} {x['agrees']}"
        )
    a.out.write_text(json.dumps({"results_file": str(a.results.relative_to(REPO)), "cases": out}, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
