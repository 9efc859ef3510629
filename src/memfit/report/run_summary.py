"""One JSON summary of a workflow run: what a lent GPU's few minutes proved (benchmarks/gpu_check.sh).

`summarize(results, snakemake_log)` reads what the workflow left: Snakemake's own log (every
job's rule, wildcards, status and seconds, from its timestamps), and per model/GPU/method run
the candidates table of `memfit.results` (the selected configuration; each probe's predicted and
measured peaks and step time), train/summary.json (the run's measured peaks and step time beside
the selection's prediction) and verify_resume.json (the resume verdict), and whether the report
exists. `ok` is true when every job finished, every run trained and passed its resume check, and
the report was written.

    python -m memfit.report.run_summary --results results --log .snakemake/log/<run>.snakemake.log --out summary.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from memfit.atomic import write_json_atomic
from memfit.results import read_json_object, read_run, run_dirs

_STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
_START = re.compile(r"^(?:local)?(?:rule|checkpoint) (\w+):$")
_DONE = re.compile(r"^Finished jobid: (\d+) \(Rule: (\w+)\)$")
_ERROR = re.compile(r"^Error in rule (\w+):$")
_FIELD = re.compile(r"^\s+(jobid|wildcards): (.*)$")
_STATS_ROW = re.compile(r"^(\w+)\s+(\d+)$")
# what a comparison of predicted and measured reads (bytes per rank, seconds per optimizer step)
FIGURES = ("peak_allocated_bytes", "peak_reserved_bytes", "step_time_s")


def snakemake_jobs(log_text: str) -> dict[str, Any]:
    """Every job of a Snakemake log (`.snakemake/log/*.snakemake.log`, in Snakemake 9.27's format:
    "[date]", a "rule|localrule|checkpoint|localcheckpoint NAME:" block with "jobid:" and
    "wildcards:", then "Finished jobid: N (Rule: NAME)" or "Error in rule NAME:"): rule,
    wildcards, status (done, failed, running: started and neither finished nor failed) and
    seconds between its start and its end; `planned`: the last "Job stats" table, by rule."""
    jobs: dict[str, dict[str, Any]] = {}
    planned: dict[str, int] = {}
    stamp = None
    current: dict[str, Any] | None = None  # the job whose block is being read (start or error)
    in_stats = False
    for line in log_text.splitlines():
        if m := _STAMP.match(line):
            stamp = dt.datetime.strptime(m.group(1), "%a %b %d %H:%M:%S %Y")
            continue
        if line.startswith("Job stats:"):
            in_stats, planned = True, {}
            continue
        if in_stats:
            if (m := _STATS_ROW.match(line.strip())) and m.group(1) not in ("total", "all"):
                planned[m.group(1)] = int(m.group(2))
            elif line.strip().startswith("total"):
                in_stats = False
            continue
        if m := _START.match(line):
            current = {"rule": m.group(1), "status": "running", "started": stamp}
        elif m := _ERROR.match(line):
            current = {"rule": m.group(1), "status": "failed", "ended": stamp}
        elif (m := _FIELD.match(line)) and current is not None:
            if m.group(1) == "wildcards":
                current["wildcards"] = dict(kv.split("=", 1) for kv in m.group(2).split(", ") if "=" in kv)
            else:
                job = jobs.setdefault(m.group(2), {"rule": current["rule"], "status": "running"})
                job.update({k: v for k, v in current.items() if v is not None and k != "wildcards"})
                current["job"] = job
            if "job" in current and "wildcards" in current:
                current["job"]["wildcards"] = current["wildcards"]
        elif m := _DONE.match(line):
            job = jobs.setdefault(m.group(1), {"rule": m.group(2)})
            job.update(status="done", ended=stamp)
        elif not line.strip():
            current = None
    out = []
    for jobid, job in sorted(jobs.items(), key=lambda kv: int(kv[0])):
        start, end = job.pop("started", None), job.pop("ended", None)
        job["seconds"] = int((end - start).total_seconds()) if start and end else None
        out.append({"jobid": int(jobid), **job})
    return {"jobs": [j for j in out if j["rule"] != "all"], "planned": planned}


def _pick(d: dict[str, Any] | None, prefix: str = "") -> dict[str, Any]:
    return {k: (d or {}).get(prefix + k) for k in FIGURES}


def _errors(predicted: dict[str, Any], measured: dict[str, Any]) -> dict[str, float | None]:
    """measured / predicted - 1 per figure, where both exist."""
    return {
        k: round(measured[k] / predicted[k] - 1, 4) if predicted.get(k) and measured.get(k) is not None else None
        for k in FIGURES
    }


def run_summary(run_dir: Path) -> dict[str, Any]:
    """One model/GPU/method run: the selection, its probes and training, the resume verdict."""
    rows = read_run(run_dir)
    model, gpu, method = run_dir.parts[-3:]
    probes = []
    for r in rows:
        if r.get("probe_status") is None:
            continue
        pred, meas = _pick(r, "predicted_"), _pick(r, "probe_")
        probes.append(
            {
                "id": r["id"],
                "status": r["probe_status"],
                "predicted": pred,
                "measured": meas,
                "error": _errors(pred, meas),
            }
        )
    chosen = next((r for r in rows if r.get("selected")), None)
    out: dict[str, Any] = {"model": model, "gpu": gpu, "method": method, "probes": probes}
    out["selected"] = (
        None
        if chosen is None
        else {
            "id": chosen["id"],
            "source": chosen.get("source"),
            "reason": chosen.get("reason"),
            "predicted": _pick(chosen, "predicted_"),
        }
    )
    train = run_dir / "train" / "summary.json"
    if train.exists():
        t = read_json_object(train, "training summary")
        measured = _pick(t)
        out["train"] = {"steps": t.get("steps"), "measured": measured, "memory_source": t.get("memory_source")}
        if chosen is not None:
            out["train"]["error_vs_selected"] = _errors(out["selected"]["predicted"], measured)
    check = run_dir / "verify_resume.json"
    if check.exists():
        v = read_json_object(check, "resume check")
        keep = ("passed", "expected", "losses_bitwise_equal", "weights_bitwise_equal", "max_rel_loss_diff", "rtol")
        out["resume"] = {k: v.get(k) for k in keep if k in v}
    return out


def summarize(results: Path, snakemake_log: Path | None = None) -> dict[str, Any]:
    """The whole run (module docstring)."""
    results = Path(results)
    jobs = snakemake_jobs(snakemake_log.read_text()) if snakemake_log and snakemake_log.exists() else None
    runs = [run_summary(d) for d in run_dirs(results)] if results.exists() else []
    report = results / "report.html"
    out: dict[str, Any] = {"jobs": jobs, "runs": runs, "report": str(report) if report.exists() else None}
    done = Counter(j["rule"] for j in (jobs or {}).get("jobs", []) if j["status"] == "done")
    out["not_finished"] = sorted(
        [f"{j['rule']} ({j['status']})" for j in (jobs or {}).get("jobs", []) if j["status"] != "done"]
        + [
            f"{rule} (not started)"
            for rule, n in (jobs or {}).get("planned", {}).items()
            if done[rule] + _seen(jobs, rule) < n
        ]
    )
    out["ok"] = bool(
        jobs
        and not out["not_finished"]
        and runs
        and all("train" in r and (r.get("resume") or {}).get("passed") for r in runs)
        and out["report"]
    )
    return out


def _seen(jobs: dict[str, Any] | None, rule: str) -> int:
    """Jobs of `rule` that started and did not finish (counted once, as failed or running)."""
    return sum(1 for j in (jobs or {}).get("jobs", []) if j["rule"] == rule and j["status"] != "done")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m memfit.report.run_summary", description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default="results", help="the workflow's results directory")
    ap.add_argument("--log", type=Path, help="Snakemake's log of the run (.snakemake/log/*.snakemake.log)")
    ap.add_argument("--out", type=Path, help="write the JSON here (else print it)")
    a = ap.parse_args(argv)
    doc = summarize(Path(a.results), a.log)
    if a.out:
        write_json_atomic(a.out, doc)
    else:
        print(json.dumps(doc, indent=1, default=str))
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
