"""The fit map: for the selected configuration of a run, the longest sequence that fits on each
GPU type of the catalog (config/gpus.yaml), computed at report time with `memfit.estimate.fit`
(what `memfit fit --maximize seq_len` prints: a binary search over seq_len with analytic
activations, so a few milliseconds per GPU type).

`fit_results` computes it once per run; `fit_grid` lays out all runs at once, the page's only fit map:
GPU types down, model x method across, with why a GPU type cannot train a setup at all
(templates/fitgrid.html.j2).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from memfit.estimate import DEFAULT_SETTINGS
from memfit.estimate.models import catalog
from memfit.estimate.search import fit
from memfit.space import Candidate

from .fmt import _bytes, _plain
from .inputs import RunOutputs

SETTINGS = dataclasses.replace(DEFAULT_SETTINGS, activations="analytic")
MAX_NOTE = " (the model's maximum)"
GRID_SHOWN = 10  # GPU types the grid shows; the rest fold below it


@dataclass(frozen=True)
class GpuFit:
    gpu: str
    memory_gib: float
    longest: int  # tokens; 0 when not even one token fits
    at_max: bool  # longest is the model's maximum (max_position_embeddings)
    why: str  # when nothing fits: what one token would need


@dataclass(frozen=True)
class FitResult:
    seq_len: int | None  # the selected configuration's
    num_gpus: int
    gpus: list[GpuFit]
    error: str | None = None  # why there is no map

    def ok(self, g: GpuFit) -> bool:
        return bool(g.longest) and self.seq_len is not None and g.longest >= self.seq_len


def _arch(run: RunOutputs, root: Path):
    """The catalog card by model name, else the run's model directory (run.json's model_path)."""
    try:
        return catalog.model(str(run.selection.model), allow_moe=True)
    except Exception:  # noqa: BLE001 - not a catalog name: try the model directory below
        run_json = Path(run.path).parent / "run.json"
        model_path = json.loads(run_json.read_text()).get("model_path") if run_json.is_file() else None
        if not model_path:
            raise
        p = Path(model_path)
        return catalog.model(p if p.is_absolute() else root / p, allow_moe=True)


def fit_result(run: RunOutputs, root: Path) -> FitResult:
    """The longest trainable sequence of the run's selected configuration on each catalog GPU type."""
    sel = run.selection
    world = run.table.world_size if run.table is not None else None
    num_gpus = int(world or 1)
    shown = run.shown
    if shown is None:
        return FitResult(None, num_gpus, [], "selected.json lists no candidates")
    seq = shown.candidate.get("seq_len")
    try:
        arch = _arch(run, root)
        cand = Candidate.from_dict(shown.candidate)
        gpus = []
        for name, gpu in catalog.load_gpus().items():
            longest, est = fit(
                arch,
                gpu,
                num_gpus,
                1,
                str(sel.method),
                cand,
                "seq_len",
                host_memory_gb=None,
                settings=SETTINGS,
            )
            why = ""
            if not longest and est is not None:
                # at 1 token: what it would need, so a reader sees whether the GPU or the host is short
                d = est.to_dict()
                why = d.get("reason") or (
                    f"at 1 token needs {_bytes(d.get('device_total_bytes'))} per GPU, {_bytes(d.get('host_bytes'))} host RAM per node"
                )
            gpus.append(
                GpuFit(
                    name,
                    float(gpu.memory_gib),
                    int(longest),
                    longest == arch.max_position_embeddings,
                    why,
                )
            )
    except Exception as e:  # noqa: BLE001 - the map is an aid: say why it is missing, keep the page
        return FitResult(seq, num_gpus, [], f"{type(e).__name__}: {e}")
    return FitResult(cand.seq_len, num_gpus, gpus)


def fit_results(runs: list[RunOutputs], root: Path) -> list[FitResult]:
    return [fit_result(r, root) for r in runs]


def _cell(res: FitResult, g: GpuFit, here: bool) -> dict:
    """A grid cell: green when the selected sequence length fits, amber when only a shorter one does."""
    if not g.longest:
        text, cls = "—", "bad"
    else:
        text, cls = _plain(g.longest) + (" (max)" if g.at_max else ""), "ok" if res.ok(g) else "short"
    return {"text": text, "cls": cls + (" here" if here else ""), "why": g.why}


def fit_grid(runs: list[RunOutputs], results: list[FitResult]) -> dict:
    """The grid's data (templates/fitgrid.html.j2): GPU types down, one column per model x method
    x selected configuration across, each cell the longest trainable sequence; the runs' own GPU
    types marked `here`."""
    # one column per distinct setup: runs of the same model and method that selected the same
    # configuration (typically for several GPU types) give the same map
    cols: dict[tuple, dict] = {}
    unmapped = []
    for run, res in zip(runs, results, strict=True):
        if res.error is not None:
            unmapped.append(f"{run.title}: {res.error}")
            continue
        s = run.selection
        # a run where nothing fits shows its closest candidate, in a column of its own
        key = (str(s.model), str(s.method), run.shown.id, res.num_gpus, run.selected is None)
        col = cols.setdefault(key, {"res": res, "gpus": [], "run": run})
        col["gpus"].append(str(s.gpu))
    columns = list(cols.values())  # numbered in the order first seen; shown grouped by model
    models = list(dict.fromkeys(k[0] for k in cols))
    ordered = [cols[k] for m in models for k in cols if k[0] == m]
    names = list(dict.fromkeys(g.gpu for c in columns for g in c["res"].gpus))
    mem = {g.gpu: g.memory_gib for c in columns for g in c["res"].gpus}
    rows = []
    for name in names:
        cells = []
        for c in ordered:
            g = next((g for g in c["res"].gpus if g.gpu == name), None)
            cells.append(None if g is None else _cell(c["res"], g, name in c["gpus"]))
        rows.append(
            {"gpu": name, "memory_gib": mem[name], "cells": cells, "here": any(name in c["gpus"] for c in ordered)}
        )
    # ten rows in view, the runs' own GPU types among them wherever the catalog lists them; the rest fold away
    shown = [r for r in rows if r["here"]][:GRID_SHOWN]
    shown += [r for r in rows if not r["here"]][: GRID_SHOWN - len(shown)]
    rest = [r for r in rows if r not in shown]
    rows = [r for r in rows if r in shown]
    legend = [
        {"number": i, "model": c["run"].selection.model, "method": c["run"].selection.method, "id": c["run"].shown.id,
         "selected": c["run"].selected is not None, "gpus": c["gpus"], "num_gpus": c["res"].num_gpus, "seq_len": c["res"].seq_len,
         "cannot": [(g.gpu, g.why) for g in c["res"].gpus if not g.longest]}
        for i, c in enumerate(columns, 1)
    ]  # fmt: skip
    return {
        "models": [(m, sum(1 for k in cols if k[0] == m)) for m in models],
        "columns": [
            {
                "method": c["run"].selection.method,
                "none_fits": c["run"].selected is None,
                "number": columns.index(c) + 1,
            }
            for c in ordered
        ],
        "rows": rows,
        "rest": rest,
        "legend": legend,
        "unmapped": unmapped,
    }
