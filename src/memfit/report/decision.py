"""Why the selected candidate won, in words: selected.json's `decision` (memfit.estimate.selection).

Selection takes the fastest fitting candidate unless others are within the noise of its
throughput; then the tie rule (less device memory, then fewer levers, then the candidate id)
picks among the tied ones. `chosen_because` says which of these decided, and by how much.
"""

from __future__ import annotations

from typing import Any

from memfit.estimate.rows import CandidateRow
from memfit.estimate.selection import levers

from .fmt import _bytes, _num

# The tie rule's steps, in its order (memfit.estimate.selection.TIE_RULE).
TIE_STEPS = ("less device memory", "fewer memory levers at the same device memory", "the candidate id, first in order")


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{abs(x):.0%}"


def _tie_step(best: CandidateRow, others: list[CandidateRow]) -> int:
    """Index into TIE_STEPS of the step that set `best` apart from every other tied row."""
    step = 0
    for o in others:
        if (best.device_bytes or 0) < (o.device_bytes or 0):
            continue
        if (best.device_bytes or 0) == (o.device_bytes or 0) and levers(best.candidate) < levers(o.candidate):
            step = max(step, 1)
        else:
            step = 2
    return step


def chosen_because(selected: CandidateRow | None, rows: list[CandidateRow]) -> dict[str, Any] | None:
    """{"word": the deciding reason, "detail": its figures in a sentence}; None without a decision
    (a selected.json written before selection recorded one, or nothing selected)."""
    d = selected.decision if selected is not None else None
    if not isinstance(d, dict):
        return None
    by, runner = d.get("by"), d.get("runner_up")
    margin, noise = _num(d.get("margin")), _num(d.get("noise"))
    measured = selected.source == "measured"
    kind = "measured noise" if measured else "noise allowance of predicted step times"
    if by == "speed":
        return {
            "word": "fastest",
            "detail": f"{_pct(margin)} more throughput than the runner-up, {runner}, more than the {kind} "
            f"({_pct(noise)})",
        }
    if by == "tie rule":
        by_id = {r.id: r for r in rows}
        others = [by_id[i] for i in d.get("tied") or [] if i in by_id and i != selected.id]
        step = _tie_step(selected, others)
        speed = (
            f"the runner-up, {runner}, is {_pct(margin)} faster"
            if margin is not None and margin < 0
            else f"{_pct(margin)} more throughput than the runner-up, {runner}"
        )
        n = f"{len(others)} other candidate" + ("s" if len(others) != 1 else "")
        detail = f"tied with {n} within the {kind} ({_pct(noise)}): {speed}"
        if step == 0 and others:
            least = _bytes(min(o.device_bytes or 0 for o in others))
            than = f"the others' at least {least}" if len(others) > 1 else least
            detail += f"; its device peak is {_bytes(selected.device_bytes)} against {than}"
        return {"word": f"tied on speed, so {TIE_STEPS[step]}", "detail": detail}
    if by == "only candidate that fits":
        return {"word": "the only candidate that fits", "detail": ""}
    return {"word": str(by), "detail": ""}
