"""Which configuration to run: the fastest one that fits, and why every other one lost.

A candidate fits when its peak device memory, grown by `headroom`, stays within the
device budget and its host memory within the node's RAM. Measured figures (probes)
win over predicted ones: a probed candidate is judged on what it used, an unprobed one
can only be chosen when no probe ran (`plan_only`), and then on its prediction.
Speed is training throughput at the fixed global batch: tokens per second per node.
"""

from __future__ import annotations

from typing import Any

from .rows import Budget, CandidateRow, EstimateRow, Figures, Prediction
from .units import fmt_bytes

__all__ = ["Budget", "choose", "judge"]


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
        row = CandidateRow(id=est.id, candidate=est.candidate, predicted=Prediction.of(est), source="", fits=False, reason="")
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


def _verdict(row: CandidateRow, dev: int, host: int, step_time: float | None, budget: Budget, world: int, method: str, source: str) -> None:
    tokens_per_s = _tokens_per_step(row.candidate, world, method) / step_time if step_time else None
    row.source, row.figures = source, Figures(dev, host, step_time, tokens_per_s)
    if dev > budget.device_limit_bytes:
        row.fits, row.reason = False, (
            f"does not fit: {fmt_bytes(dev)} {source} > {fmt_bytes(budget.device_limit_bytes)} "
            f"({fmt_bytes(budget.device_bytes)} less {budget.headroom:.0%} headroom)"
        )
    elif host > budget.host_bytes:
        row.fits, row.reason = False, f"host RAM: {fmt_bytes(host)} {source} > {fmt_bytes(budget.host_bytes)}"
    else:
        row.fits, row.reason = True, ""


def choose(rows: list[CandidateRow]) -> tuple[CandidateRow, list[CandidateRow]]:
    """The fastest fitting measured candidate (predicted only if nothing was measured)."""
    probed = any(r.source in ("probe", "measured") for r in rows)
    pool = [r for r in rows if r.source == "measured"] if probed else rows
    fitting = [r for r in pool if r.fits and r.tokens_per_s]
    if not fitting:
        lines = "\n".join(f"  {r.id}: {r.reason or 'no throughput figure'}" for r in rows)
        raise RuntimeError(
            "no candidate fits the budget; every one lost:\n" + lines + "\nWiden the search space "
            "(offload, ZeRO-3, LoRA, gradient checkpointing), lower seq_len, or add GPUs."
        )
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
