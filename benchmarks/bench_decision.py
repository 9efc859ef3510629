"""Time to decision: memfit's selection (estimate -> top-K probes -> select) against brute force
(probe every candidate of the search space -> select), on the embedded demo.

Both sides call the workflow's own stage functions (`memfit.workflow.pipeline.estimate_candidates`,
`probe_candidate`, `select_config`), no Snakemake; probes are real (config `num_gpus` DeepSpeed
ranks on the `cpu` device, `probe.steps` optimizer steps on the worst-case batch, the device
capacity from `cpu_memory_mib`). The demo model and the prepared data are made once beforehand
and not timed (both sides need them).

- memfit: estimate_candidates (predict all, mark `probe.top_k` probes) + those probes + select.
- brute force: a probe of every valid candidate + select among them all (no estimate needed;
  the candidates table it probes from is written untimed). `--limit N` probes only the first N
  candidates in the space's order; the full brute-force time is then extrapolated from the mean
  probe time (marked as such), and "same pick" compares against the best of those N only.

Usage (from the repository root):
  .venv/bin/python benchmarks/bench_decision.py [--method sft] [--limit N] [--json out.json]
"""

from __future__ import annotations

import argparse
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

from memfit.workflow import pipeline  # noqa: E402
from memfit.workflow.config import WorkflowConfig  # noqa: E402


def _probe_all(cfg: WorkflowConfig, method: str, ids: list[str], table: Path, model: Path, data: Path,
               out: Path) -> tuple[list[Path], list[float]]:  # fmt: skip
    paths, times = [], []
    for i, cid in enumerate(ids, 1):
        p = out / "probes" / f"{cid}.json"
        t0 = time.perf_counter()
        r = pipeline.probe_candidate(cfg, method, cid, table, str(model), str(data), p, out / "probes" / f"{cid}.log")
        times.append(time.perf_counter() - t0)
        print(f"  [{i}/{len(ids)}] {cid}: {r['status']} in {times[-1]:.1f} s", flush=True)
        paths.append(p)
    return paths, times


def _select(cfg: WorkflowConfig, method: str, table: Path, probes: list[Path], model: Path, data: Path,
            out: Path) -> str:  # fmt: skip
    files = {k: out / f for k, f in (("selected", "selected.json"), ("ds_config", "ds_config.json"),
                                     ("run", "run.json"), ("launch", "launch.sh"))}  # fmt: skip
    sel = pipeline.select_config(cfg, "demo-tiny", "cpu", method, table, probes, str(model), str(data),
                                 str(out / "train"), files)  # fmt: skip
    return sel["selected"]["id"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(REPO / "config/config.yaml"))
    ap.add_argument("--method", default="sft", choices=["sft", "dpo"])
    ap.add_argument("--limit", type=int, default=None, help="brute force probes only the first N candidates")
    ap.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)

    from memfit.data import prepare
    from memfit.workflow.demo import build_demo_model

    os.chdir(REPO)  # the config's relative paths (data/demo, config/models) are the repository's
    raw = WorkflowConfig.from_file(args.config).raw
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-decision-"))
    if "trace_cache" in (raw.get("estimate") or {}):
        raw["estimate"]["trace_cache"] = str(work / "traces")  # cold cache: a first run's estimate
    cfg = WorkflowConfig.load(raw)
    method = args.method
    entry = cfg.model("demo-tiny")
    model = work / "demo-tiny"
    if not model.exists():
        build_demo_model(REPO / entry.build, REPO / "data/demo", model)
    data = work / "data" / method
    if not data.exists():
        d = raw["data"]
        prepare(method, REPO / d[method], model, data, max_len=int(d["max_len"]),
                eval_fraction=float(d["eval_fraction"]), seed=int(d["seed"]))  # fmt: skip
    raw["models"]["demo-tiny"]["path"] = str(model)

    print(
        f"memfit: estimate -> top-{cfg.probe.top_k} probes -> select ({method}, {cfg.world_size} ranks)",
        flush=True,
    )
    m_out = work / "memfit"
    t0 = time.perf_counter()
    table = pipeline.estimate_candidates(cfg, "demo-tiny", "cpu", method, m_out / "candidates.json")
    t_est = time.perf_counter() - t0
    probes, _ = _probe_all(cfg, method, table["probe"], m_out / "candidates.json", model, data, m_out)
    m_pick = _select(cfg, method, m_out / "candidates.json", probes, model, data, m_out)
    t_memfit = time.perf_counter() - t0

    b_out = work / "brute"
    b_table = pipeline.estimate_candidates(cfg, "demo-tiny", "cpu", method, b_out / "candidates.json")  # untimed
    valid = [r["id"] for r in b_table["rows"] if not r["invalid"]]
    ids = valid[: args.limit] if args.limit else valid
    print(f"brute force: {len(ids)} of {len(valid)} candidates probed -> select", flush=True)
    t0 = time.perf_counter()
    probes, times = _probe_all(cfg, method, ids, b_out / "candidates.json", model, data, b_out)
    try:
        b_pick = _select(cfg, method, b_out / "candidates.json", probes, model, data, b_out)
    except RuntimeError:
        b_pick = None  # none of the probed ones fits
    t_brute = time.perf_counter() - t0
    full = len(ids) == len(valid)
    t_brute_full = t_brute if full else statistics.mean(times) * len(valid)

    result = {
        "method": method,
        "candidates": len(valid),
        "memfit": {"probes": len(table["probe"]), "estimate_s": round(t_est, 1), "wall_s": round(t_memfit, 1),
                   "selected": m_pick},
        "brute_force": {"probes": len(ids), "wall_s": round(t_brute, 1), "selected": b_pick,
                        "full_wall_s": round(t_brute_full, 1), "full_is_extrapolated": not full},
        "same_pick": m_pick == b_pick,
        "ratio": round(t_brute_full / t_memfit, 2),
    }  # fmt: skip
    print(f"memfit:      {t_memfit:7.1f} s  ({len(table['probe'])} probes, estimate {t_est:.1f} s) -> {m_pick}")
    print(f"brute force: {t_brute:7.1f} s  ({len(ids)} of {len(valid)} probes) -> {b_pick}")
    if not full:
        print(
            f"brute force, all {len(valid)}: {t_brute_full:.0f} s extrapolated (mean probe {statistics.mean(times):.1f} s)"
        )
    scope = "" if full else f" (brute force over the first {len(ids)} only)"
    print(f"same candidate: {'yes' if result['same_pick'] else 'no'}{scope}")
    print(f"ratio brute force / memfit: {result['ratio']:.2f}x{'' if full else ' (extrapolated)'}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
