"""The calibrated CPU path as the demo meets it: its probes against their calibrated predictions.

Issue #22's bars, restated by #42: on the demo (2 CPU ranks), the step times of the candidates
the workflow probes are predicted within 1.2x in the median and 1.5x at worst (measured /
predicted, or its inverse, whichever is larger), and the predicted order of the probes matches
the measured one (Spearman >= 0.9 per method).

Each round runs what the workflow runs, through the library and not Snakemake: the calibrate
stage (`memfit.workflow.calibrate.calibrate`), `estimate_candidates` with that calibration, and
the probes it marks (`probe_candidate`, the demo's `probe.steps`, its device capacity), then
prices every probe with the estimator's calibrated step time. Rounds run one after another, so
a change in the machine's load shows as a change between rounds; the load average is printed
before and after each round. DPO probes start from the demo's base model, not the SFT output
(the step time does not depend on the weights' values), so no training is needed.

Setup (once, in a scratch directory, not results/): the demo model, its tokenizer and the
tokenized SFT and DPO data.

Usage (from the repository root):
  .venv/bin/python benchmarks/bench_calibrated_cpu.py [--rounds 2] [--method sft] [--json OUT.json]
      [--work DIR]   (reuse the demo model and data built there)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from memfit.estimate.time import timing  # noqa: E402
from memfit.workflow import calibrate as calibrate_stage  # noqa: E402
from memfit.workflow import demo, pipeline  # noqa: E402
from memfit.workflow.config import WorkflowConfig, load_yaml  # noqa: E402

MODEL, GPU = "demo-tiny", "cpu"
BARS = {"median_ratio": 1.2, "worst_ratio": 1.5, "spearman": 0.9}


def setup(work: Path, raw: dict, steps: int | None = None) -> dict:
    """The demo model and tokenized data under `work` (built once); the config pointing at them
    (with `steps` optimizer steps per probe instead of the demo's, if given)."""
    model_dir = work / "demo-tiny"
    if not (model_dir / "config.json").exists():
        data_src = work / "source"
        demo.write_data(data_src)
        demo.build_demo_model(REPO / raw["models"][MODEL]["build"], data_src, model_dir)
    cfg = copy.deepcopy(raw)
    cfg["models"] = {MODEL: {"path": str(model_dir)}}
    cfg["estimate"] = {**(cfg.get("estimate") or {}), "trace_cache": str(work / "traces")}
    if steps:
        cfg["probe"] = {**cfg["probe"], "steps": steps}
    d = cfg["data"]
    for method in cfg["methods"]:
        out = work / "data" / method
        if not (out / "stats.json").exists():
            pipeline.prepare_data(
                method,
                str(REPO / d[method]),
                str(model_dir),
                out,
                max_len=d["max_len"],
                eval_fraction=d["eval_fraction"],
                seed=d["seed"],
            )
    return cfg


def ratio(measured: float, predicted: float) -> float:
    """How far apart, as a factor >= 1 either way."""
    return max(measured / predicted, predicted / measured)


def one_round(cfg: WorkflowConfig, work: Path, methods: list[str], demo_steps: int, log) -> dict:
    rdir = work / f"round-{time.strftime('%H%M%S')}"
    rdir.mkdir(parents=True)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    cal = rdir / "calibration.json"
    calibrate_stage.calibrate(cfg, MODEL, cal, rdir / "calibrate.log")
    log(f"  calibrated in {time.perf_counter() - t0:.0f} s")
    out: dict = {"load_before": load0, "calibration": json.loads(cal.read_text()), "methods": {}}
    for method in methods:
        cands = rdir / f"{method}-candidates.json"
        est = pipeline.estimate_candidates(cfg, MODEL, GPU, method, cands, cal)
        by_id = {r["id"]: r for r in est["rows"]}
        rows = []
        for cid in est["probe"]:
            res = pipeline.probe_candidate(
                cfg, method, cid, cands, str(work / "demo-tiny"), str(work / "data" / method),
                rdir / f"{method}-{cid}.json", rdir / f"{method}-{cid}.log",
            )  # fmt: skip
            row = by_id[cid]
            m = res.get("step_time_s") if res["status"] == "ok" else None
            rows.append(
                {
                    "id": cid,
                    "status": res["status"],
                    "measured_s": m,
                    "steady_s": res.get("steady_step_times_s"),
                    "first_s": res.get("first_step_time_s"),
                    "predicted_s": row["step_time_s"],
                    "breakdown": row["time_breakdown"],
                    "time_source": row["time_source"],
                }
            )
            log(f"  {method} {cid}: {res['status']} measured {m or 0:.3f} s, predicted {row['step_time_s']:.3f} s")
        out["methods"][method] = {"rows": rows, "summary": summary(rows, demo_steps)}
    out["load_after"] = os.getloadavg()
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def summary(rows: list[dict], demo_steps: int = 3) -> dict:
    """Ratios and Spearman of the probes' step time as the demo's probe reports it (the median of
    its steps after the first, `demo_steps` steps) and, when the probes ran longer, of the steps
    after those (`steady_*`: the step time once the process is warm, which training runs at)."""
    ok = [r for r in rows if r["measured_s"]]
    if not ok:
        return {"probes": 0}
    out = {"probes": len(ok)}
    figures = {"": [statistics.median(r["steady_s"][: demo_steps - 1]) for r in ok]}
    if all(len(r["steady_s"]) > demo_steps for r in ok):
        figures["steady_"] = [statistics.median(r["steady_s"][demo_steps - 1 :]) for r in ok]
    for prefix, measured in figures.items():
        ratios = [ratio(m, r["predicted_s"]) for m, r in zip(measured, ok, strict=True)]
        out[prefix + "median_ratio"] = statistics.median(ratios)
        out[prefix + "worst_ratio"] = max(ratios)
        out[prefix + "spearman"] = timing.spearman([r["predicted_s"] for r in ok], measured)
    return out


def report(rounds: list[dict]) -> None:
    for i, rd in enumerate(rounds, 1):
        print(f"\nround {i}: load average {rd['load_before'][0]:.2f} before, {rd['load_after'][0]:.2f} after")
        for method, m in rd["methods"].items():
            print(f"  {method}: {'probe':58s} {'measured':>9s} {'predicted':>9s} {'m/p':>6s}")
            for r in sorted(m["rows"], key=lambda r: r["predicted_s"]):
                if r["measured_s"]:
                    print(
                        f"    {r['id']:58s} {r['measured_s']:8.3f}s {r['predicted_s']:8.3f}s "
                        f"{r['measured_s'] / r['predicted_s']:6.2f}"
                    )
                else:
                    print(f"    {r['id']:58s} {r['status']}")
            s = m["summary"]
            for prefix, what in (("", "as the demo's probe reports it"), ("steady_", "steps after those")):
                if s["probes"] and prefix + "median_ratio" in s:
                    met = all(
                        (s[prefix + k] >= v) if k == "spearman" else (s[prefix + k] <= v)
                        for k, v in BARS.items()
                        if s[prefix + k] == s[prefix + k]
                    )
                    print(
                        f"  {method} ({what}): median x{s[prefix + 'median_ratio']:.2f}, worst "
                        f"x{s[prefix + 'worst_ratio']:.2f}, Spearman {s[prefix + 'spearman']:.2f} over "
                        f"{s['probes']} probes ({'meets' if met else 'misses'} the bars x{BARS['median_ratio']}, "
                        f"x{BARS['worst_ratio']}, {BARS['spearman']})"
                    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(REPO / "config/config.yaml"))
    ap.add_argument("--method", choices=["sft", "dpo"], action="append")
    ap.add_argument("--rounds", type=int, default=2, help="calibrate + probes, one round after another")
    ap.add_argument("--work", help="scratch directory (kept; reused for the model and data)")
    ap.add_argument(
        "--steps",
        type=int,
        help="optimizer steps per probe instead of the demo's (its figure stays the median of its own "
        "steps after the first; the later steps give the steady figure)",
    )
    ap.add_argument("--json", help="write every round's rows and summaries here")
    args = ap.parse_args()
    raw = load_yaml(args.config)
    work = Path(args.work or f"/tmp/bench-calibrated-cpu-{os.getpid()}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    if args.steps is not None and args.steps < 2:
        ap.error(f"--steps {args.steps}: a probe needs at least 2 steps (the first is not timed)")
    cfg = WorkflowConfig.of(setup(work, raw, args.steps))
    methods = args.method or list(cfg.methods)
    rounds = []
    for i in range(args.rounds):
        print(f"round {i + 1}/{args.rounds} (load average {os.getloadavg()[0]:.2f})", flush=True)
        rounds.append(one_round(cfg, work, methods, raw["probe"]["steps"], lambda line: print(line, flush=True)))
        if args.json:
            Path(args.json).write_text(json.dumps({"rounds": rounds}, indent=1) + "\n")
    report(rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
