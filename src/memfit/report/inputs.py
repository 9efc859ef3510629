"""The report's inputs: the run's JSON files read and checked once into typed objects.

selected.json must be what `memfit.estimate.selection` writes (a malformed one raises `ReportError`
naming the file and key); candidates.json and metrics.jsonl beside it are optional: when
missing or unreadable a note on the page says so and the report goes on.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import pandas as pd

from memfit import results
from memfit.estimate.rows import CandidateRow, CandidateTable, RowError, Selection


class ReportError(ValueError):
    """A report input that cannot be read; the message starts with the file's path."""


@dataclass
class RunOutputs:
    """One (model, gpu, method) run directory and what was found for it."""

    path: Path  # selected.json
    selection: Selection
    table: CandidateTable | None = None  # candidates.json beside selected.json
    summary: dict[str, Any] | None = None
    summary_path: Path | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    resume: dict[str, Any] | None = None
    resume_path: Path | None = None
    notes: list[str] = field(default_factory=list)  # what could not be read, said on the page

    @property
    def rows(self) -> list[CandidateRow]:
        rows = list(self.selection.candidates)
        sel = self.selected
        if sel is not None and not any(r.id == sel.id for r in rows):
            rows.insert(0, sel)
        return rows

    @cached_property
    def candidates(self) -> pd.DataFrame:
        """This run's rows of the candidate table (memfit.results): one per candidate, in
        selected.json's ranking, then candidates.json's rows selection did not list. Read once the
        run's summary and resume check are matched to it (the page is rendered after read_inputs)."""
        s = self.selection
        rows = results.run_rows((s.model, s.gpu, s.method), s, self.table, None, self.summary, self.resume)
        return results.frame(rows)

    @cached_property
    def records(self) -> list[dict[str, Any]]:
        """`candidates` as plain dicts (a missing value is None)."""
        return results.records(self.candidates)

    @property
    def ranked(self) -> list[dict[str, Any]]:
        """The records of the candidates selected.json ranks, best first (what the tables list)."""
        return [r for r in self.records if r["rank"] is not None]

    @property
    def selected(self) -> CandidateRow | None:
        """The chosen candidate; None in a plan where no candidate fits (`none_fits` says why)."""
        return self.selection.selected

    @property
    def selected_id(self) -> str | None:
        return None if self.selected is None else self.selected.id

    @property
    def none_fits(self) -> str | None:
        return self.selection.none_fits if self.selected is None else None

    @property
    def shown(self) -> CandidateRow | None:
        """The candidate the fit map is drawn for: the selected one, else the closest to fitting
        (select ranks it first when nothing fits)."""
        if self.selected is not None:
            return self.selected
        return self.selection.candidates[0] if self.selection.candidates else None

    @property
    def title(self) -> str:
        s = self.selection
        return " · ".join(str(v or "?") for v in (s.model, s.gpu, s.method))


@dataclass
class Inputs:
    """Everything the page shows: the runs, the data stats, and files matched to no run."""

    runs: list[RunOutputs]
    stats: list[tuple[Path, dict[str, Any]]]
    loose_summaries: list[tuple[Path, dict[str, Any], list[dict[str, Any]], list[str]]]
    loose_resume: list[tuple[Path, dict[str, Any]]]


PathArg = Any  # a path, or an iterable of paths, or None


def read_inputs(selected: PathArg, summaries: PathArg, resume: PathArg, data_stats: PathArg) -> Inputs:
    """Read every input; `summaries` and `resume` are matched to runs by directory
    (`<run>/train/summary.json`, `<run>/verify_resume.json`)."""
    runs = [load_run(Path(p)) for p in _paths(selected)]
    by_dir = {_key(r.path.parent): r for r in runs}
    inputs = Inputs(runs, [], [], [])
    for p in map(Path, _paths(summaries)):
        summary = read_json(p, "training summary")
        run = by_dir.get(_key(p.parent.parent))
        if run is None:
            inputs.loose_summaries.append((p, summary, *read_metrics(p.parent / "metrics.jsonl")))
            continue
        run.summary, run.summary_path = summary, p
        run.metrics, skipped = read_metrics(p.parent / "metrics.jsonl")
        run.notes += skipped
    for p in map(Path, _paths(resume)):
        check = read_json(p, "resume check")
        run = by_dir.get(_key(p.parent))
        if run is None:
            inputs.loose_resume.append((p, check))
        else:
            run.resume, run.resume_path = check, p
    inputs.stats = [(Path(p), read_json(Path(p), "data stats")) for p in _paths(data_stats)]
    return inputs


def _paths(x: Any) -> list[Any]:
    if x is None:
        return []
    if isinstance(x, (str, os.PathLike)):
        return [x]
    return list(x)


def _key(p: Path) -> str:
    return str(p.resolve())


def read_json(path: Path, what: str) -> dict[str, Any]:
    return results.read_json_object(path, what, ReportError)


def load_run(path: Path) -> RunOutputs:
    try:
        selection = Selection.from_json(read_json(path, "selection (selected.json)"))
    except RowError as e:
        raise ReportError(f"{path}: {e}") from None
    run = RunOutputs(path=path, selection=selection)
    table_path = path.parent / "candidates.json"
    if table_path.exists():
        try:
            run.table = CandidateTable.from_json(read_json(table_path, "candidate table"))
        except ReportError as e:
            run.notes.append(f"predicted breakdown not shown: {e}")
        except RowError as e:
            run.notes.append(f"predicted breakdown not shown: {table_path}: {e}")
    return run


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Metric rows by (step, split), the last one winning; unreadable lines are counted, not fatal."""
    if not path.exists():
        return [], [f"{path}: no metrics file, so no training curves"]
    rows: dict[tuple[Any, Any], dict[str, Any]] = {}
    bad = 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        step = r.get("step") if isinstance(r, dict) else None
        if isinstance(step, (int, float)) and not isinstance(step, bool) and math.isfinite(step):
            rows[(r["step"], r.get("split", "train"))] = r
        else:
            bad += 1
    notes = [f"{path}: {bad} line(s) could not be read and are left out of the curves"] if bad else []
    return sorted(rows.values(), key=lambda r: r["step"]), notes
