"""The answer, for the page's first screen (templates/answer.html.j2): per run, the chosen
configuration in words, its margin to the budget, the final train and eval loss, the resume
verdict, and predicted against measured peak and step time; for a plan, why the best
alternatives lost.

Throughput has two definitions in memfit and the page names each where it prints one:
probe tok/s counts the padded worst-case batch on all ranks (what selection compares,
memfit.workflow.probe), training tok/s the real (non-padding) tokens on rank 0
(memfit.train.loop: `tokens_per_s`, "non-padding tokens per second, this rank").
"""

from __future__ import annotations

from typing import Any

from .fmt import _bytes, _num, _plain, _secs, _verdict, describe
from .inputs import RunOutputs

ALTERNATIVES = 3  # a plan names this many runners-up and why each lost

PROBE_TPS = "probe tok/s: padded worst-case batch, all ranks"
TRAIN_TPS = "training tok/s: real tokens, rank 0"


def final_loss(metrics: list[dict[str, Any]] | None, split: str) -> tuple[Any, Any] | None:
    """(step, loss) of the last logged row of `split` with a loss; None if there is none."""
    for r in reversed(metrics or []):
        if r.get("split", "train") == split and _num(r.get("loss")) is not None:
            return r.get("step"), r["loss"]
    return None


def median_tps(metrics: list[dict[str, Any]] | None) -> float | None:
    """Training throughput: the median `tokens_per_s` of the logged training steps (rank 0, real tokens)."""
    tps = sorted(
        v for v in (_num(r.get("tokens_per_s")) for r in metrics or [] if r.get("split", "train") == "train") if v
    )
    return tps[len(tps) // 2] if tps else None


def _vs(predicted: Any, measured: Any, fmt, what: str) -> str:
    """'predicted P, measured M (+x%)', or whichever of the two exists."""
    p, m = _num(predicted), _num(measured)
    if p is None and m is None:
        return "—"
    if m is None:
        return f"predicted {fmt(p)}, not measured"
    if p is None:
        return f"{what} {fmt(m)}, no prediction"
    err = f" ({p / m - 1:+.0%})" if m else ""
    return f"predicted {fmt(p)}, {what} {fmt(m)}{err}"


def _margin(run: RunOutputs) -> dict[str, Any] | None:
    """The usable budget (device memory less the headroom kept free) less the peak that counts:
    training's (reserved where the device reports it, else allocated), else what selection judged."""
    b, s = run.selection.budget, run.selected
    if s is None or b is None or _num(getattr(b, "device_bytes", None)) is None:
        return None
    usable = b.device_bytes * (1 - (b.headroom or 0))
    summary = run.summary or {}
    peak, of = summary.get("peak_reserved_bytes"), "training peak reserved"
    if _num(peak) is None:
        peak, of = summary.get("peak_allocated_bytes"), "training peak allocated"
    if _num(peak) is None:
        peak, of = s.device_bytes, f"{s.source} peak"
    if _num(peak) is None:
        return None
    left = usable - peak
    return {"bytes": left, "fraction": left / usable if usable else None, "of": of, "usable": usable,
            "text": f"{_bytes(left)} ({left / usable:.0%}) below the usable {_bytes(usable)}" if left >= 0
            else f"{_bytes(-left)} OVER the usable {_bytes(usable)}", "ok": left >= 0}  # fmt: skip


def _alternatives(run: RunOutputs) -> list[dict[str, Any]]:
    """The best-ranked candidates other than the one shown, with the verdict and why each lost."""
    shown = run.shown.id if run.shown else None
    out = []
    for r in run.ranked:
        if r["id"] == shown:
            continue
        verdict, cls = _verdict(r, run.selected_id)
        out.append({"rank": r["rank"], "id": r["id"], "verdict": verdict, "verdict_class": cls,
                    "reason": r["reason"] or "—", "device": r["predicted_device_total_bytes"]})  # fmt: skip
        if len(out) == ALTERNATIVES:
            break
    return out


def answer_row(run: RunOutputs, index: int, resume: tuple[str, str]) -> dict[str, Any]:
    """One run's answer (`resume`: the verdict word and css class, view.resume_status)."""
    s, sel, summary = run.selected, run.selection, run.summary or {}
    world = summary.get("world_size") or (run.table.world_size if run.table is not None else None)
    row: dict[str, Any] = {
        "index": index, "title": run.title, "plan_only": sel.plan_only, "none_fits": run.none_fits,
        "id": None if s is None else s.id,
        "described": describe(s.candidate, str(sel.method), world) if s is not None else "",
        "margin": _margin(run), "resume": resume, "trained": bool(run.summary),
        "alternatives": _alternatives(run) if sel.plan_only or s is None else [],
    }  # fmt: skip
    if s is None:
        return row
    probe = s.probe if s.probe and s.probe.get("status", "ok") == "ok" else {}
    measured_by = "training" if run.summary else "probe" if probe else None
    got = summary if run.summary else probe
    row["peak"] = _vs(s.predicted.peak_allocated_bytes, got.get("peak_allocated_bytes"), _bytes, measured_by or "")
    row["step"] = _vs(s.predicted.step_time_s, got.get("step_time_s"), _secs, measured_by or "")
    row["measured_by"] = measured_by
    row["losses"] = [(split, final_loss(run.metrics, split)) for split in ("train", "eval")]
    row["probe_tps"] = s.tokens_per_s if s.source == "measured" else None
    row["predicted_tps"] = s.tokens_per_s if s.source != "measured" else None
    row["train_tps"] = median_tps(run.metrics)
    row["loss_text"] = " · ".join(
        f"{split} {_plain(x[1])} (step {_plain(x[0])})" if x else f"{split} —" for split, x in row["losses"]
    )
    return row
