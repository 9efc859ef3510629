"""Step time, predicted vs measured, for every candidate of the demo's search space (CPU truth).

1. Calibrate this machine (memfit.workflow.calibrate: the ranks of `num_gpus`, the demo model's own
   code, DeepSpeed on gloo), or reuse `--calibration FILE`.
2. Probe every valid candidate of each method (real DeepSpeed, `--steps` optimizer steps on the
   worst-case batch, no device-capacity limit so every candidate gets a time; the median of the
   steps after the first is the measurement).
3. Print predicted vs measured per candidate, the median and worst |error|, Spearman's rank
   correlation, and whether the measured-fastest candidate that fits the demo's budget is among
   the `probe.top_k` memfit would probe (predicted fastest of those predicted to fit).

Both the calibrated prediction (memfit.estimate.time.timing) and the uncalibrated one (40% MFU,
memfit.estimate.time.costs.step_time) are printed, the second for comparison.

Needs the demo's model, data and SFT output: run `make demo` first.

Usage (from the repository root):
  .venv/bin/python benchmarks/bench_step_time.py [--method sft] [--steps 8] [--limit N]
      [--calibration results/demo-tiny/cpu/calibration.json] [--json benchmarks/results/step_time_cpu.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from memfit.estimate.time import timing  # noqa: E402
from memfit.space import Candidate  # noqa: E402
from memfit.workflow import calibrate as calibrate_stage  # noqa: E402
from memfit.workflow import pipeline  # noqa: E402
from memfit.workflow.config import WorkflowConfig, load_yaml  # noqa: E402
from memfit.workflow.probe import run_probe  # noqa: E402

MODEL, GPU = "demo-tiny", "cpu"


def _probe(cfg: WorkflowConfig, method: str, cand: Candidate, steps: int, work: Path) -> dict:
    data = REPO / f"results/{MODEL}/data/{method}"
    model = cfg.policy_path(MODEL, GPU, method)
    run = cfg.run_config(method, cand.to_dict(), str(model), str(data), str(work))
    out = work / f"{method}-{cand.id}.json"
    return run_probe(
        dataclasses.replace(run, device_capacity_bytes=None), cfg.num_gpus, out, log=work / "probe.log", steps=steps
    )


def _report(method: str, rows: list[dict], top_k: int) -> dict:
    ok = [r for r in rows if r["measured_s"]]
    errs = [r["predicted_s"] / r["measured_s"] - 1 for r in ok]
    unc = [r["uncalibrated_s"] / r["measured_s"] - 1 for r in ok]
    print(f"\n{method}: {len(ok)} candidates measured")
    print(f"  {'candidate':58s} {'measured':>9s} {'predicted':>9s} {'error':>7s} {'40% MFU':>8s}")
    for r, e in sorted(zip(ok, errs, strict=True), key=lambda x: x[0]["measured_s"]):
        print(f"  {r['id']:58s} {r['measured_s']:8.3f}s {r['predicted_s']:8.3f}s {e:+7.1%} {r['uncalibrated_s']:7.3f}s")
    fitting = [r for r in ok if r["fits"]]
    probed = sorted(fitting, key=lambda r: r["predicted_s"])[:top_k]
    fastest = min(fitting, key=lambda r: r["measured_s"]) if fitting else None
    summary = {
        "candidates": len(ok),
        "median_abs_error": statistics.median(abs(e) for e in errs),
        "worst_abs_error": max(abs(e) for e in errs),
        "spearman": timing.spearman([r["predicted_s"] for r in ok], [r["measured_s"] for r in ok]),
        "uncalibrated_median_abs_error": statistics.median(abs(e) for e in unc),
        "uncalibrated_spearman": timing.spearman([r["uncalibrated_s"] for r in ok], [r["measured_s"] for r in ok]),
        "measured_fastest_fitting": fastest["id"] if fastest else None,
        "fastest_among_top_k": bool(fastest and fastest in probed),
        "top_k": top_k,
    }
    print(
        f"  median |error| {summary['median_abs_error']:.1%}, worst {summary['worst_abs_error']:.1%}, "
        f"Spearman {summary['spearman']:.3f} (40% MFU: median {summary['uncalibrated_median_abs_error']:.0%}, "
        f"Spearman {summary['uncalibrated_spearman']:.3f}); measured fastest that fits: {summary['measured_fastest_fitting']} "
        f"({'among' if summary['fastest_among_top_k'] else 'NOT among'} the top {top_k} predicted)"
    )
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(REPO / "config/config.yaml"))
    ap.add_argument("--method", choices=["sft", "dpo"], action="append")
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per probe (median of all but the first)")
    ap.add_argument("--limit", type=int, default=0, help="probe only the first N candidates per method")
    ap.add_argument(
        "--only", default="", help="probe only candidates whose id contains this text (e.g. ref-precomputed)"
    )
    ap.add_argument("--calibration", help="reuse this calibration.json instead of measuring")
    ap.add_argument("--json", help="write the rows and summaries here")
    args = ap.parse_args()
    os.chdir(REPO)
    cfg = WorkflowConfig.of(load_yaml(args.config))
    if not (REPO / f"results/{MODEL}/{GPU}/sft/train/model").exists():
        sys.exit("bench_step_time: run `make demo` first (the DPO probes start from the SFT output)")
    with tempfile.TemporaryDirectory(prefix="bench-step-time-") as tmp:
        work = Path(tmp)
        if args.calibration:
            cal_path = Path(args.calibration)
        else:
            cal_path = work / "calibration.json"
            t0 = time.perf_counter()
            calibrate_stage.calibrate(cfg, MODEL, cal_path, work / "calibrate.log")
            print(f"calibrated in {time.perf_counter() - t0:.0f} s", flush=True)
        out: dict = {"calibration": json.loads(cal_path.read_text()), "methods": {}}
        for method in args.method or cfg.methods:
            est = pipeline.estimate_candidates(cfg, MODEL, GPU, method, work / f"{method}.json", cal_path)
            assumed = pipeline.estimate_candidates(cfg, MODEL, GPU, method, work / f"{method}-assumed.json")
            assumed_s = {r["id"]: r["step_time_s"] for r in assumed["rows"]}
            rows = []
            todo = [r for r in est["rows"] if not r["invalid"] and args.only in r["id"]][: args.limit or None]
            for i, r in enumerate(todo, 1):
                res = _probe(cfg, method, Candidate.from_dict(r["candidate"]), args.steps, work)
                measured = res.get("step_time_s") if res["status"] == "ok" else None
                print(f"  [{i}/{len(todo)}] {method} {r['id']}: {res['status']} {measured or 0:.3f} s", flush=True)
                if not r["time_source"].startswith("measured"):
                    sys.exit(f"bench_step_time: {r['id']} was not priced from the calibration: {r['time_source']}")
                rows.append(
                    {
                        "id": r["id"],
                        "candidate": r["candidate"],
                        "measured_s": measured,
                        "predicted_s": r["step_time_s"],
                        "breakdown": r["time_breakdown"],
                        "uncalibrated_s": assumed_s[r["id"]],
                        "fits": r["fits"],
                    }
                )
            out["methods"][method] = {"rows": rows, "summary": _report(method, rows, cfg.probe.top_k)}
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
