"""Where a training run's curves were interrupted: resumes, OOM fallbacks and the resume check.

Sources, all written by the workflow:
- train/metrics.jsonl: the first training row after a resume carries `resumed_from_step`
  (memfit.train.loop.Trainer.fit); metrics rows up to the checkpoint are kept and the rest redone, so
  the curve stays continuous.
- train/summary.json `fallbacks`: `[{"oom_step", "resumed_from_step", "from", "to", "phase",
  "op", "bytes_live", "capacity_bytes"}]`, one per OOM the training recovered from by switching
  to the next candidate of selected.json's ranking (absent or [] when none). An older summary
  without row marks still says that its last launch resumed (`resume_peak_allocated_bytes`); the
  step is then `last step - steps run by that launch`.
- verify_resume.json `from_step`: where the resume check restarted a copy of the finished run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .fmt import _bytes, _num, _plain
from .inputs import RunOutputs

FALLBACK_KEYS = (
    "oom_step",
    "resumed_from_step",
    "from",
    "to",
    "phase",
    "op",
    "bytes_live",
    "capacity_bytes",
)


@dataclass(frozen=True)
class Mark:
    """A vertical line on every panel of the training curves."""

    step: float
    kind: str  # "resume" | "oom" | "fallback" | "resume-check"
    short: str  # drawn on the chart
    label: str  # the page's list of marks: the whole story
    redo_from: float | None = None  # oom: the steps (redo_from, step] were lost and run again


@dataclass(frozen=True)
class Fallback:
    oom_step: int
    resumed_from_step: int
    src: str
    dst: str
    phase: str
    op: str | None
    bytes_live: float | None
    capacity_bytes: float | None


def _int(x: Any) -> int | None:
    v = _num(x)
    return int(v) if v is not None and v.is_integer() else None


def read_fallbacks(summary: dict[str, Any] | None) -> tuple[list[Fallback], list[str]]:
    """The summary's `fallbacks`, checked; an entry that is not the agreed shape becomes a note."""
    items = (summary or {}).get("fallbacks")
    if not items:
        return [], []
    if not isinstance(items, list):
        return [], [f"train/summary.json: 'fallbacks' is not a list ({type(items).__name__}); not shown"]
    out, notes = [], []
    for i, f in enumerate(items):
        if not isinstance(f, dict):
            notes.append(f"train/summary.json: fallbacks[{i}] is not an object; not shown")
            continue
        oom, back = _int(f.get("oom_step")), _int(f.get("resumed_from_step"))
        missing = [k for k, v in (("oom_step", oom), ("resumed_from_step", back)) if v is None]
        missing += [k for k in ("from", "to") if not isinstance(f.get(k), str)]
        if missing:
            notes.append(f"train/summary.json: fallbacks[{i}] lacks {', '.join(missing)}; not shown")
            continue
        op = f.get("op")
        out.append(
            Fallback(oom, back, f["from"], f["to"], str(f.get("phase") or "?"), None if op is None else str(op),
                     _num(f.get("bytes_live")), _num(f.get("capacity_bytes")))
        )  # fmt: skip
    return out, notes


def _resume_steps(run: RunOutputs, inferred: bool = True) -> list[tuple[int, str]]:
    """(step, where it was read) of each resume of the training itself; with `inferred`, an older
    summary's last resume when no metrics row marks one."""
    rows = [r for r in run.metrics if r.get("split", "train") == "train"]
    marked = [(s, "metrics.jsonl") for s in (_int(r.get("resumed_from_step")) for r in rows) if s is not None]
    if marked:
        return marked
    s = run.summary or {}
    ran, last = _int(s.get("steps")), max((_int(r.get("step")) or 0 for r in rows), default=0)
    if inferred and s.get("resume_peak_allocated_bytes") is not None and ran is not None and 0 < last - ran < last:
        return [(last - ran, "summary.json")]
    return []


def training_marks(run: RunOutputs) -> list[Mark]:
    """Every mark for the run's curves, in step order."""
    fallbacks, _ = read_fallbacks(run.summary)
    marks = []
    for n, f in enumerate(fallbacks, 1):
        where = f.phase + (f", {f.op}" if f.op else "")
        live = ""
        if f.bytes_live is not None and f.capacity_bytes is not None:
            live = f", {_bytes(f.bytes_live)} live of a {_bytes(f.capacity_bytes)} capacity"
        marks.append(
            Mark(
                f.oom_step,
                "oom",
                f"OOM {n} at step {f.oom_step}",
                f"out of memory at step {f.oom_step} ({where}{live}) on {f.src}",
                redo_from=f.resumed_from_step,
            )
        )
        marks.append(Mark(f.resumed_from_step, "fallback", f"fallback {n}: resumed from {f.resumed_from_step}",
                          f"resumed from the checkpoint at step {f.resumed_from_step} on {f.dst} "
                          f"(steps {f.resumed_from_step + 1}-{f.oom_step} run again)"))  # fmt: skip
    switched = {f.resumed_from_step for f in fallbacks}
    for step, src in _resume_steps(run, inferred=not fallbacks):
        if step not in switched:  # a fallback's relaunch resumes too: marked once, as the fallback
            marks.append(Mark(step, "resume", f"resumed from {step}",
                              f"training resumed from its checkpoint at step {step} (a relaunch after a crash or preemption; from {src})"))  # fmt: skip
    check = run.resume or {}
    frm = _int(check.get("from_step"))
    if frm is not None:
        verdict = {True: "passed", False: "FAILED"}.get(check.get("passed"), "result unknown")
        marks.append(Mark(frm, "resume-check", f"resume check from {frm}",
                          f"resume check: a copy of the finished run restarted from the checkpoint at step {frm} "
                          f"and was compared with these curves ({verdict})"))  # fmt: skip
    return sorted(marks, key=lambda m: (m.step, m.kind))


def changed_levers(run: RunOutputs, src: str, dst: str) -> str:
    """The levers that differ between two candidates of the selection, e.g. 'micro_batch 4 → 2'."""
    by_id = {r.id: r.candidate for r in run.rows}
    a, b = by_id.get(src), by_id.get(dst)
    if a is None or b is None:
        return "—"
    diff = [f"{k} {_plain(a.get(k))} → {_plain(b.get(k))}" for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]
    return ", ".join(diff) or "same configuration"
