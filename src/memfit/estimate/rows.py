"""The rows that travel between stages, typed: candidates.json (estimate) -> selected.json (select) -> report.

`from_json` checks a row once, where it is read, and raises `RowError` naming the file and the
key (`selected.json: candidates[3].fits: expected a boolean, got 'yes'`); code past that point
reads attributes, not dicts. `to_json` writes exactly the keys the JSON files have always had
(other stages and users read them), so a row survives `from_json(to_json())` unchanged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

SOURCES = ("measured", "probe", "predicted", "rule")  # what a verdict rests on (see memfit.estimate.selection)


class RowError(ValueError):
    """A row of candidates.json or selected.json that is not what the writer writes."""


@dataclass(frozen=True)
class Budget:
    device_bytes: int  # usable memory of one device (rank)
    host_bytes: int  # usable RAM of one node
    headroom: float  # fraction of device memory kept free (fragmentation, spikes)
    # "given" (the config's or the user's value) or where a derived margin comes from
    # (`derived_budget`, memfit.estimate.models.calibration.device_margin)
    headroom_source: str = "given"

    @property
    def device_limit_bytes(self) -> int:
        return int(self.device_bytes * (1.0 - self.headroom))


# --------------------------------------------------------------------------- checks
def _where(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _obj(d: Any, where: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise RowError(f"{where or 'top level'}: expected an object, got {type(d).__name__}")
    return d


def _get(d: dict[str, Any], key: str, where: str, kind: str, required: bool = True) -> Any:
    """d[key], checked against kind (str, int, number, bool, object, list); None when optional and absent/null."""
    if key not in d or d[key] is None:
        if required:
            raise RowError(f"{_where(where, key)}: missing")
        return None
    v = d[key]
    ok = {
        "str": isinstance(v, str),
        "int": isinstance(v, int) and not isinstance(v, bool),
        "number": isinstance(v, (int, float)) and not isinstance(v, bool),
        "bool": isinstance(v, bool),
        "object": isinstance(v, dict),
        "list": isinstance(v, list),
    }[kind]
    if not ok:
        raise RowError(f"{_where(where, key)}: expected {kind}, got {v!r:.80}")
    return v


# --------------------------------------------------------------------------- candidates.json
@dataclass(frozen=True)
class EstimateRow:
    """One row of candidates.json as select and report read it (memfit.estimate writes more keys)."""

    id: str
    candidate: dict[str, Any]  # memfit.space.Candidate as a dict
    invalid: bool = False
    reason: str | None = None  # why it cannot run here, when invalid
    peak_allocated_bytes: float | None = None
    peak_reserved_bytes: float | None = None
    device_total_bytes: float | None = None  # reserved + CUDA context: what selection judges
    host_bytes: float | None = None
    step_time_s: float | None = None
    fits: bool | None = None
    breakdown: dict[str, Any] | None = None  # bytes per component at the peak
    notes: list[str] | None = None
    tokens_per_s: float | None = None  # predicted throughput over all ranks
    peak_phase: str | None = None  # the phase of a step that holds the device peak
    phases: dict[str, Any] | None = None  # allocated device bytes at each phase's peak
    host_phases: dict[str, Any] | None = None  # host bytes per node at each phase's peak

    @classmethod
    def from_json(cls, d: Any, where: str = "") -> EstimateRow:
        d = _obj(d, where)
        nums = ("peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes", "host_bytes", "step_time_s")
        return cls(
            id=_get(d, "id", where, "str"),
            candidate=_get(d, "candidate", where, "object"),
            invalid=bool(_get(d, "invalid", where, "bool", required=False)),
            reason=_get(d, "reason", where, "str", required=False),
            fits=_get(d, "fits", where, "bool", required=False),
            breakdown=_get(d, "breakdown", where, "object", required=False),
            notes=_get(d, "notes", where, "list", required=False),
            peak_phase=_get(d, "peak_phase", where, "str", required=False),
            phases=_get(d, "phases", where, "object", required=False),
            host_phases=_get(d, "host_phases", where, "object", required=False),
            **{k: _get(d, k, where, "number", required=False) for k in (*nums, "tokens_per_s")},
        )


@dataclass(frozen=True)
class CandidateTable:
    """candidates.json: the estimated search space of one (model, gpu, method)."""

    world_size: int
    budget: Budget
    rows: list[EstimateRow]
    estimator: str | None = None
    reference_compare: dict[str, str] | None = None  # DPO: {"precomputed"|"adapter": id, "model": id}

    @classmethod
    def from_json(cls, d: Any, where: str = "") -> CandidateTable:
        d = _obj(d, where)
        rows = _get(d, "rows", where, "list")
        return cls(
            world_size=_get(d, "world_size", where, "int"),
            budget=budget_from_json(_get(d, "budget", where, "object"), _where(where, "budget")),
            rows=[EstimateRow.from_json(r, _where(where, f"rows[{i}]")) for i, r in enumerate(rows)],
            estimator=_get(d, "estimator", where, "str", required=False),
            reference_compare=_get(d, "reference_compare", where, "object", required=False),
        )


def budget_from_json(d: Any, where: str = "budget") -> Budget:
    d = _obj(d, where)
    return Budget(
        device_bytes=_get(d, "device_bytes", where, "int"),
        host_bytes=_get(d, "host_bytes", where, "int"),
        headroom=_get(d, "headroom", where, "number"),
        headroom_source=_get(d, "headroom_source", where, "str", required=False) or "given",
    )


def derived_budget(device_bytes: int, host_bytes: int, gpu_name: str, compute_capability: str) -> Budget:
    """The budget when no headroom is given: the margin derived from the spread of memfit's own
    device-total error on this GPU (its calibration file's `device_margin`, else the uncalibrated
    one), named in `headroom_source` (docs/estimator.md, "The margin")."""
    from memfit.estimate.models import calibration

    margin, source = calibration.device_margin(calibration.for_gpu(gpu_name, compute_capability))
    return Budget(device_bytes=device_bytes, host_bytes=host_bytes, headroom=margin, headroom_source=source)


# --------------------------------------------------------------------------- selected.json
@dataclass(frozen=True)
class Prediction:
    """The estimator's figures for a candidate, as selection copies them into its row."""

    peak_allocated_bytes: float | None
    peak_reserved_bytes: float | None
    device_total_bytes: float | None
    host_bytes: float | None
    step_time_s: float | None
    fits: bool | None

    @classmethod
    def of(cls, est: EstimateRow) -> Prediction:
        return cls(**{f.name: getattr(est, f.name) for f in fields(cls)})

    @classmethod
    def from_json(cls, d: Any, where: str) -> Prediction:
        d = _obj(d, where)
        nums = {f.name: _get(d, f.name, where, "number", required=False) for f in fields(cls) if f.name != "fits"}
        return cls(fits=_get(d, "fits", where, "bool", required=False), **nums)


@dataclass(frozen=True)
class Figures:
    """What a verdict was judged on (measured by a probe or predicted); absent when there were none."""

    device_bytes: int
    host_bytes: int
    step_time_s: float | None
    tokens_per_s: float | None  # training throughput at the fixed global batch, per node


@dataclass
class CandidateRow:
    """One candidate in selected.json: its prediction, its probe (if any), the verdict and why."""

    id: str
    candidate: dict[str, Any]
    predicted: Prediction
    source: str  # one of SOURCES
    fits: bool
    reason: str
    probe: dict[str, Any] | None = None  # the probe's JSON (memfit.workflow.probe) as written
    figures: Figures | None = None
    # the selected row only: how it was chosen (memfit.estimate.selection._decide): by speed or the
    # tie rule, the runner-up, the margin over it and the measured noise
    decision: dict[str, Any] | None = None

    @property
    def device_bytes(self) -> int | None:
        return self.figures.device_bytes if self.figures else None

    @property
    def host_bytes(self) -> int | None:
        return self.figures.host_bytes if self.figures else None

    @property
    def step_time_s(self) -> float | None:
        return self.figures.step_time_s if self.figures else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.figures.tokens_per_s if self.figures else None

    @property
    def probe_status(self) -> str | None:
        return None if self.probe is None else self.probe.get("status")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "candidate": self.candidate,
            "predicted": asdict(self.predicted),
            "source": self.source,
            "fits": self.fits,
            "reason": self.reason,
        }
        if self.probe is not None:
            out["probe"] = self.probe
        if self.figures is not None:
            out |= asdict(self.figures)
        if self.decision is not None:
            out["decision"] = self.decision
        return out

    @classmethod
    def from_json(cls, d: Any, where: str) -> CandidateRow:
        d = _obj(d, where)
        source = _get(d, "source", where, "str")
        if source not in SOURCES:
            raise RowError(f"{_where(where, 'source')}: {source!r} is not one of {', '.join(SOURCES)}")
        probe = _get(d, "probe", where, "object", required=False)
        if probe is not None:
            _get(probe, "status", _where(where, "probe"), "str")
        figures = None
        if "device_bytes" in d:  # judged on figures of its own (not a failed probe, not a rule)
            figures = Figures(
                device_bytes=_get(d, "device_bytes", where, "int"),
                host_bytes=_get(d, "host_bytes", where, "int"),
                step_time_s=_get(d, "step_time_s", where, "number", required=False),
                tokens_per_s=_get(d, "tokens_per_s", where, "number", required=False),
            )
        return cls(
            id=_get(d, "id", where, "str"),
            candidate=_get(d, "candidate", where, "object"),
            predicted=Prediction.from_json(_get(d, "predicted", where, "object"), _where(where, "predicted")),
            source=source,
            fits=_get(d, "fits", where, "bool"),
            reason=_get(d, "reason", where, "str"),
            probe=probe,
            figures=figures,
            decision=_get(d, "decision", where, "object", required=False),
        )


@dataclass
class Selection:
    """selected.json: the chosen candidate, every candidate ranked with its reason, how to launch.
    A plan where nothing fits has `selected` and `launch` None and says why in `none_fits`."""

    model: str
    gpu: str
    method: str
    selected: CandidateRow | None
    budget: Budget
    plan_only: bool
    launch: str | None
    candidates: list[CandidateRow]
    none_fits: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "gpu": self.gpu,
            "method": self.method,
            "selected": None if self.selected is None else self.selected.to_json(),
            **({"none_fits": self.none_fits} if self.none_fits is not None else {}),
            # headroom_source only where the margin was derived (the files' keys are unchanged otherwise)
            "budget": {k: v for k, v in asdict(self.budget).items() if (k, v) != ("headroom_source", "given")},
            "plan_only": self.plan_only,
            "launch": self.launch,
            "candidates": [r.to_json() for r in self.candidates],
        }

    @classmethod
    def from_json(cls, d: Any, where: str = "") -> Selection:
        d = _obj(d, where)
        cands = _get(d, "candidates", where, "list")
        none_fits = _get(d, "none_fits", where, "str", required=False)
        if d.get("selected") is None and none_fits is None:
            raise RowError(f"{_where(where, 'selected')}: missing (and no none_fits saying why nothing was selected)")
        return cls(
            model=_get(d, "model", where, "str"),
            gpu=_get(d, "gpu", where, "str"),
            method=_get(d, "method", where, "str"),
            selected=None
            if none_fits is not None
            else CandidateRow.from_json(_get(d, "selected", where, "object"), _where(where, "selected")),
            budget=budget_from_json(_get(d, "budget", where, "object"), _where(where, "budget")),
            plan_only=_get(d, "plan_only", where, "bool"),
            launch=None if none_fits is not None else _get(d, "launch", where, "str"),
            candidates=[CandidateRow.from_json(r, _where(where, f"candidates[{i}]")) for i, r in enumerate(cands)],
            none_fits=none_fits,
        )
