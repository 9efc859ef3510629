"""Every candidate of every run as one tidy pandas DataFrame: `memfit.results.load("results")`.

One row per candidate of each (model, gpu, method) run under `results/`, read from the files the
workflow writes: candidates.json (the prediction), selected.json (the verdict and the probe each
verdict rests on; probes/<id>.json where selected.json is not written yet), train/summary.json
(which candidates trained, OOM fallbacks included) and verify_resume.json. Columns:

- `model`, `gpu`, `method`, `id`, `rank` (selected.json's ranking: 1 is the selected one; NA
  before selection), `plan_only`, `world_size`, `budget_device_bytes`, `budget_host_bytes`, `headroom`;
- each lever of `memfit.space.Candidate` under its own name (`zero`, `offload_optimizer`, ...,
  `micro_batch`, `seq_len`, `grad_accum`, `precision`, `ref`, `loss_impl`);
- `predicted_*`: the estimate (`predicted_peak_allocated_bytes`, `..._reserved_bytes`,
  `predicted_device_total_bytes`, `predicted_host_bytes`, `predicted_step_time_s`,
  `predicted_tokens_per_s`, `predicted_fits`, `predicted_peak_phase`), the components at the
  peak (`predicted_breakdown_<component>_bytes`) and each phase's peak
  (`predicted_phase_<phase>_bytes` on the device, `predicted_host_phase_<phase>_bytes` per node);
  `invalid`, `invalid_reason` where the hardware cannot run it;
- the verdict as `memfit.estimate.selection` judged it: `source` (measured | probe | predicted | rule), `fits`,
  `reason`, and the figures judged on: `device_bytes`, `host_bytes`, `step_time_s`, `tokens_per_s`;
- the probe: `probe_status` (ok | oom | timeout | error; NA when not probed),
  `probe_peak_allocated_bytes`, `probe_peak_reserved_bytes`, `probe_host_bytes` (node RSS),
  `probe_step_time_s`, `probe_error`, and where an OOM happened: `probe_oom_phase`,
  `probe_oom_op`, `probe_oom_live_bytes`, `probe_oom_capacity_bytes`;
- `selected`, `trained` (training ran on it: the selected candidate, and each OOM fallback's
  target), `resume_check` (passed | failed | unknown on the candidate training finished on; NA
  where no check ran).

Bytes are per device (rank) unless the name says host; times in seconds per optimizer step;
throughput in tokens per second per node at the fixed global batch (memfit.estimate.selection).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from memfit.estimate.rows import CandidateRow, CandidateTable, RowError, Selection
from memfit.space import Candidate

__all__ = ["ResultsError", "frame", "load", "records", "run_rows", "write_parquet"]

KEYS = ("model", "gpu", "method")
LEVERS = tuple(f.name for f in dataclasses.fields(Candidate))
# the estimator's components at the peak (memfit.estimate: `breakdown`, design contract)
BREAKDOWN = ("params", "grads", "optimizer", "activations", "logits", "reference", "temporaries", "overheads")
PREDICTED = (
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "device_total_bytes",
    "host_bytes",
    "step_time_s",
    "tokens_per_s",
    "fits",
    "peak_phase",
)
PROBE = {  # column: key in the probe's JSON (memfit.workflow.probe.run_probe)
    "probe_peak_allocated_bytes": "peak_allocated_bytes",
    "probe_peak_reserved_bytes": "peak_reserved_bytes",
    "probe_host_bytes": "host_rss_bytes_node",
    "probe_step_time_s": "step_time_s",
    "probe_error": "error",
}
OOM = ("phase", "op", "live_bytes", "capacity_bytes")  # where a probe ran out of device memory
JUDGED = ("device_bytes", "host_bytes", "step_time_s", "tokens_per_s")


class ResultsError(ValueError):
    """A results file that cannot be read; the message starts with the file's path."""


def _estimate_columns(est: Any) -> dict[str, Any]:
    """The prediction of one candidates.json row (a `memfit.estimate.rows.EstimateRow`)."""
    out: dict[str, Any] = {f"predicted_{k}": getattr(est, k) for k in PREDICTED}
    out["invalid"], out["invalid_reason"] = est.invalid, est.reason if est.invalid else None
    breakdown = est.breakdown or {}
    out |= {f"predicted_breakdown_{k}_bytes": breakdown.get(k) for k in BREAKDOWN if est.breakdown is not None}
    out |= {f"predicted_phase_{k}_bytes": v for k, v in (est.phases or {}).items()}
    out |= {f"predicted_host_phase_{k}_bytes": v for k, v in (est.host_phases or {}).items()}
    return out


def _probe_columns(probe: Mapping[str, Any] | None) -> dict[str, Any]:
    if probe is None:
        return {"probe_status": None}
    oom = probe.get("oom") or {}
    return {
        "probe_status": probe.get("status"),
        **{col: probe.get(key) for col, key in PROBE.items()},
        **{f"probe_oom_{k}": oom.get(k) for k in OOM},
    }


def _verdict_columns(row: CandidateRow) -> dict[str, Any]:
    """What selection judged: the source, fits, reason and the figures it judged on."""
    out = {"source": row.source, "fits": row.fits, "reason": row.reason or None}
    out |= {k: getattr(row, k) for k in JUDGED}
    p = row.predicted
    out |= {f"predicted_{f.name}": getattr(p, f.name) for f in dataclasses.fields(p)}
    return out


def _trained_ids(selection: Selection | None, summary: Mapping[str, Any] | None) -> list[str]:
    """The candidates training ran on, in order: the selected one, then each OOM fallback's target."""
    if summary is None or selection is None or selection.selected is None:
        return []
    ids = [selection.selected.id]
    for f in summary.get("fallbacks") or []:
        if isinstance(f, dict) and isinstance(f.get("to"), str):
            ids.append(f["to"])
    return ids


def _resume_word(check: Mapping[str, Any] | None) -> str | None:
    if check is None:
        return None
    return {True: "passed", False: "failed"}.get(check.get("passed"), "unknown")


def run_rows(
    run: tuple[str, str, str],
    selection: Selection | None = None,
    table: CandidateTable | None = None,
    probes: Mapping[str, Mapping[str, Any]] | None = None,
    summary: Mapping[str, Any] | None = None,
    resume: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """One record per candidate of a (model, gpu, method) run, in selected.json's ranking (then
    candidates.json's order for candidates selection did not list). `probes` (id -> probe JSON)
    is read only for candidates selected.json does not carry (before select_config ran)."""
    ranked: list[CandidateRow] = []
    if selection is not None:
        ranked = list(selection.candidates)
        if selection.selected is not None and not any(r.id == selection.selected.id for r in ranked):
            ranked.insert(0, selection.selected)
    estimates = {r.id: r for r in table.rows} if table is not None else {}
    order = [r.id for r in ranked] + [i for i in estimates if i not in {r.id for r in ranked}]
    by_id = {r.id: r for r in ranked}
    trained = _trained_ids(selection, summary)
    budget = selection.budget if selection is not None else table.budget if table is not None else None
    out = []
    for n, cid in enumerate(order, 1):
        row, est = by_id.get(cid), estimates.get(cid)
        rec: dict[str, Any] = dict(zip(KEYS, run, strict=True)) | {"id": cid, "rank": n if row is not None else None}
        rec["plan_only"] = selection.plan_only if selection is not None else None
        rec["world_size"] = table.world_size if table is not None else (summary or {}).get("world_size")
        if budget is not None:
            rec |= {
                "budget_device_bytes": budget.device_bytes,
                "budget_host_bytes": budget.host_bytes,
                "headroom": budget.headroom,
            }
        cand = (row.candidate if row is not None else est.candidate) or {}
        rec |= {k: cand.get(k, DEFAULTS[k]) for k in LEVERS} | {k: v for k, v in cand.items() if k not in LEVERS}
        if est is not None:
            rec |= _estimate_columns(est)
        if row is not None:
            rec |= _verdict_columns(row)
            rec |= _probe_columns(row.probe)
        else:  # not judged yet: the prediction's verdict, the probe if one ran
            rec |= {"source": "rule" if est.invalid else "predicted", "fits": bool(est.fits) and not est.invalid}
            rec |= _probe_columns((probes or {}).get(cid))
        rec["probed"] = rec["probe_status"] is not None
        rec["selected"] = selection is not None and selection.selected is not None and selection.selected.id == cid
        rec["trained"] = cid in trained
        rec["resume_check"] = _resume_word(resume) if trained and cid == trained[-1] else None
        out.append(rec)
    return out


FIRST = (*KEYS, "id", "rank", *LEVERS)
LAST = ("probed", "selected", "trained", "resume_check")
# every table has these columns, whatever its runs hold (the phases' columns are the phases found)
COLUMNS = (
    *FIRST, "plan_only", "world_size", "budget_device_bytes", "budget_host_bytes", "headroom",
    *(f"predicted_{k}" for k in PREDICTED), "invalid", "invalid_reason", *(f"predicted_breakdown_{k}_bytes" for k in BREAKDOWN),
    "source", "fits", "reason", *JUDGED, "probe_status", *PROBE, *(f"probe_oom_{k}" for k in OOM), *LAST,
)  # fmt: skip
DEFAULTS = Candidate().to_dict()  # a lever an older file lacks has its default (as Candidate.from_dict reads it)


def _order(col: str) -> int:
    """Columns grouped: keys and levers, the run, the prediction, the verdict, the probe, the outcome."""
    if col in FIRST:
        return 0
    if col in LAST:
        return 5
    if col.startswith(("predicted_", "invalid")):
        return 2
    if col.startswith("probe_"):
        return 4
    return 3 if col in ("source", "fits", "reason", *JUDGED) else 1


def _dtype(values: pd.Series) -> str:
    """A nullable dtype for a column built from Python values: bool, integer, float or string."""
    seen = [v for v in values if v is not None]
    if not seen:
        return "object"
    if all(isinstance(v, bool) for v in seen):
        return "boolean" if len(seen) < len(values) else "bool"
    if all(isinstance(v, int) and not isinstance(v, bool) for v in seen):
        return "Int64"
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in seen):
        return "Float64"
    return "string" if all(isinstance(v, str) for v in seen) else "object"


def frame(records: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """The records of `run_rows` as one DataFrame: the columns grouped in a fixed order (keys and
    levers, the run, the prediction, the verdict, the probe, the outcome), nullable dtypes
    (a value that is missing is <NA>, not a float NaN)."""
    records = list(records)
    seen = list(dict.fromkeys([*COLUMNS, *(k for r in records for k in r)]))
    columns = sorted(seen, key=_order)  # stable: first-seen order within a group
    raw = {c: pd.Series([r.get(c) for r in records], dtype=object) for c in columns}
    return pd.DataFrame({c: v.astype(_dtype(v)) for c, v in raw.items()}, columns=columns)


def records(df: pd.DataFrame) -> list[dict[str, Any]]:
    """The rows as plain dicts of Python values, a missing value as None (not <NA>)."""
    return [{k: None if v is pd.NA or v is None else v for k, v in r.items()} for r in df.to_dict("records")]


# --------------------------------------------------------------------------- reading files
def read_json_object(path: str | os.PathLike, what: str, error: type[Exception] = ResultsError) -> dict[str, Any]:
    """A workflow output that must be a JSON object; `error` names the file and says what is wrong
    (missing, unreadable, not JSON, not an object). The report reads its inputs with it too."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise error(f"{path}: {what} does not exist") from None
    except OSError as e:
        raise error(f"{path}: cannot read {what}: {e}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(
            f"{path}: cannot read {what}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
        ) from None
    if not isinstance(obj, dict):
        raise error(f"{path}: {what} must be a JSON object, got {type(obj).__name__}")
    return obj


def _optional(path: Path, what: str) -> dict[str, Any] | None:
    return read_json_object(path, what) if path.is_file() else None


def read_run(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of one run directory, `results/<model>/<gpu>/<method>/`."""
    d = Path(run_dir)
    try:
        sel_json = _optional(d / "selected.json", "selection")
        selection = Selection.from_json(sel_json) if sel_json is not None else None
        tab_json = _optional(d / "candidates.json", "candidate table")
        table = CandidateTable.from_json(tab_json) if tab_json is not None else None
    except RowError as e:
        raise ResultsError(f"{d}: {e}") from None
    if selection is None and table is None:
        raise ResultsError(f"{d}: neither selected.json nor candidates.json")
    run = (
        (selection.model, selection.gpu, selection.method)
        if selection is not None
        else tuple(str(tab_json.get(k) or p.name) for k, p in zip(KEYS, (d.parent.parent, d.parent, d), strict=True))
    )
    probes = {}
    if selection is None:
        probes = {p.stem: read_json_object(p, "probe") for p in sorted((d / "probes").glob("*.json"))}
    summary = _optional(d / "train" / "summary.json", "training summary")
    resume = _optional(d / "verify_resume.json", "resume check")
    return run_rows(run, selection, table, probes, summary, resume)


def run_dirs(results_dir: str | os.PathLike) -> list[Path]:
    """Every run directory under `results_dir`: `<model>/<gpu>/<method>/` holding a
    candidates.json or a selected.json."""
    root = Path(results_dir)
    found = {p.parent for name in ("candidates.json", "selected.json") for p in root.glob(f"*/*/*/{name}")}
    return sorted(found)


def load(results_dir: str | os.PathLike = "results", runs: Iterable[str | os.PathLike] | None = None) -> pd.DataFrame:
    """Every candidate of every run under `results_dir` (or of the run directories `runs`), one row each."""
    # sorted by path either way: the workflow's parquet and a notebook's load() list rows alike
    dirs = sorted({Path(r) for r in runs}) if runs is not None else run_dirs(results_dir)
    if not dirs:
        raise ResultsError(f"{results_dir}: no run (<model>/<gpu>/<method>/candidates.json) found")
    return frame(rec for d in dirs for rec in read_run(d))


def write_parquet(selected: Iterable[str | os.PathLike], out: str | os.PathLike) -> Path:
    """The table of the runs whose selected.json files are given, as parquet at `out`
    (written to a sibling, then renamed: never seen half written)."""
    df = load(runs=[Path(p).parent for p in selected])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    df.to_parquet(tmp, index=False)
    os.replace(tmp, out)
    return out
