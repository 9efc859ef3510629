"""Which configuration to run: the fastest one that fits, and why every other one lost.

A candidate fits when its peak device memory, grown by `headroom`, stays within the
device budget and its host memory within the node's RAM. Measured figures (probes)
win over predicted ones: a probed candidate is judged on what it used, an unprobed one
can only be chosen when no probe ran (`plan_only`), and then on its prediction.
Speed is training throughput at the fixed global batch: tokens per second per node.
"""

from __future__ import annotations

from typing import Any

from memfit.units import fmt_bytes
from memfit.workflow.rows import Budget, CandidateRow, EstimateRow, Figures, Prediction

__all__ = ["Budget", "NoneFits", "choose", "judge"]


class NoneFits(RuntimeError):
    """No candidate fits: `rows` holds every candidate with why it lost (closest to fitting first),
    `reason` the answer in a few sentences (the closest candidate and what it lacks, `note` if
    any, what to change); the message adds one line per candidate."""

    def __init__(self, rows: list[CandidateRow], what: str, note: str = "") -> None:
        self.rows, self.what, self.note = rows, what, note
        self.reason = f"{what}; {note}. {ADVICE}" if note else f"{what}. {ADVICE}"
        lines = "\n".join(f"  {r.id}: {r.reason or 'no throughput figure'}" for r in rows)
        super().__init__(f"{self.reason}\nEvery candidate lost:\n{lines}")


ADVICE = "Widen the search space (offload, ZeRO-3, LoRA, gradient checkpointing), lower seq_len, or add GPUs."


def _overshoot(row: CandidateRow, budget: Budget | None) -> float:
    """How far a judged row is over its tighter limit (1.0 = exactly at it); inf without figures."""
    if row.figures is None or budget is None:
        return float("inf")
    dev = row.figures.device_bytes / max(budget.device_limit_bytes, 1)
    host = row.figures.host_bytes / max(budget.host_bytes, 1)
    return max(dev, host)


def _measured_device_bytes(probe: dict[str, Any]) -> int:
    # On a GPU the allocator's reserved peak is what OOMs; on the CPU only allocated exists.
    return int(probe.get("peak_reserved_bytes") or probe["peak_allocated_bytes"])


def _tokens_per_step(cand: dict[str, Any], world: int, method: str) -> int:
    seqs = cand["micro_batch"] * cand["grad_accum"] * world * (2 if method == "dpo" else 1)
    return seqs * cand["seq_len"]


def judge(
    estimates: list[dict[str, Any]],
    probes: dict[str, dict[str, Any]],
    budget: Budget,
    world: int,
    method: str,
) -> list[CandidateRow]:
    """One verdict row per candidate (the `rows` of candidates.json): source of the figures, fits, throughput, reason."""
    rows = []
    for i, raw in enumerate(estimates):
        est = EstimateRow.from_json(raw, f"candidates.json rows[{i}]")
        probe = probes.get(est.id)
        row = CandidateRow(
            id=est.id, candidate=est.candidate, predicted=Prediction.of(est), source="", fits=False, reason=""
        )
        if est.invalid:
            row.source, row.reason = "rule", f"cannot run here: {est.reason or 'invalid'}"
        elif probe is not None:
            row.probe = probe
            if probe["status"] != "ok":
                row.source, row.reason = "probe", f"probe {probe['status']}: {probe.get('error', '')}"[:300]
            else:
                dev = _measured_device_bytes(probe)
                host = int(probe.get("host_rss_bytes_node") or 0)
                _verdict(row, dev, host, probe["step_time_s"], budget, world, method, "measured")
        else:
            dev = int(est.device_total_bytes or raw["peak_reserved_bytes"])
            _verdict(row, dev, int(raw.get("host_bytes", 0)), est.step_time_s, budget, world, method, "predicted")
        rows.append(row)
    return rows


def _verdict(
    row: CandidateRow,
    dev: int,
    host: int,
    step_time: float | None,
    budget: Budget,
    world: int,
    method: str,
    source: str,
) -> None:
    tokens_per_s = _tokens_per_step(row.candidate, world, method) / step_time if step_time else None
    row.source, row.figures = source, Figures(dev, host, step_time, tokens_per_s)
    if dev > budget.device_limit_bytes:
        row.fits, row.reason = (
            False,
            (
                f"does not fit: {fmt_bytes(dev)} {source} > {fmt_bytes(budget.device_limit_bytes)} "
                f"({fmt_bytes(budget.device_bytes)} less {budget.headroom:.0%} headroom)"
            ),
        )
    elif host > budget.host_bytes:
        row.fits, row.reason = False, f"host RAM: {fmt_bytes(host)} {source} > {fmt_bytes(budget.host_bytes)}"
    else:
        row.fits, row.reason = True, ""


def choose(rows: list[CandidateRow], budget: Budget | None = None) -> tuple[CandidateRow, list[CandidateRow]]:
    """The fastest fitting measured candidate (predicted only if nothing was measured).
    Raises `NoneFits` when there is none (with `budget`, it names the candidate closest to fitting)."""
    probed = any(r.source in ("probe", "measured") for r in rows)
    pool = [r for r in rows if r.source == "measured"] if probed else rows
    fitting = [r for r in pool if r.fits and r.tokens_per_s]
    if not fitting:
        raise none_fits(rows, budget)
    best = max(fitting, key=lambda r: r.tokens_per_s or 0.0)
    for r in rows:
        if r is best:
            r.reason = "selected: fastest that fits"
        elif r.fits and r in pool:
            r.reason = f"slower: {r.tokens_per_s:.0f} tok/s vs {best.tokens_per_s:.0f} tok/s selected"
        elif r.fits:
            r.reason = "not probed: predicted to fit, ranked below the probed candidates"
    # selected first, then what was measured, then predictions, then what cannot run
    order = {"measured": 0, "probe": 1, "predicted": 2, "rule": 3}
    ranked = sorted(rows, key=lambda r: (r is not best, order[r.source], not r.fits, -(r.tokens_per_s or 0)))
    return best, ranked


def none_fits(rows: list[CandidateRow], budget: Budget | None) -> NoneFits:
    """The answer when nothing fits: rows closest to fitting first (measured before predicted,
    those that cannot run last), and a reason naming the closest one and what it lacks."""
    order = {"measured": 0, "probe": 1, "predicted": 2, "rule": 3}
    for r in rows:
        if r.fits and not r.reason:  # fits, yet could not be chosen
            r.reason = (
                "not probed: predicted to fit, but only a measured candidate can be chosen"
                if r.source == "predicted" and any(x.source in ("probe", "measured") for x in rows)
                else "fits, but has no throughput figure to rank it by"
            )
    judged = [r for r in rows if r.figures is not None]
    closest = min(judged, key=lambda r: (order[r.source], _overshoot(r, budget))) if judged else None
    ranked = sorted(rows, key=lambda r: (r is not closest, order[r.source], _overshoot(r, budget)))
    invalid = sum(r.source == "rule" for r in rows)
    reason = f"no candidate fits the budget ({len(rows)} candidates"
    reason += f", {invalid} of them cannot run here)" if invalid else ")"
    if closest is not None:
        reason += f"; the closest, {closest.id}: {closest.reason}"
    return NoneFits(ranked, reason)
