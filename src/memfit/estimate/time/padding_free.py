"""A padding_free candidate's step time (Candidate.padding_free, docs/speed.md).

Its probe runs the worst case, every sequence seq_len tokens in the one row (memfit.train.batches
`padding_free_batch`, `dpo_padding_free_batch`, padded by `pad_to`), and the calibration measures
that shape (space.compute_key). Training computes the rows' own tokens. So the step is priced at
the worst case, as every candidate is, and its compute is scaled to the prepared data's mean tokens
per sequence (`Settings.row_tokens`, prepare_data's stats.json `length.mean`) by the model FLOPs
of both (`costs.step_flops`: under sdpa and eager the attention covers the whole row, T x T,
masked; flash-attention's varlen kernel each sequence's own square). The worst case is kept
(`Estimate.step_time_worst_case_s`): a probe compares with it, and the selection scales a
measured probe by the same ratio (memfit.estimate.selection). A padded candidate stays priced on
rows padded to seq_len.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memfit.estimate.models.arch import ModelArch
from memfit.estimate.settings import Settings
from memfit.estimate.time.costs import step_flops
from memfit.space import Candidate


def padding_free_scale(arch: ModelArch, cand: Candidate, method: str, settings: Settings) -> float:
    """The step's model FLOPs at `Settings.row_tokens` tokens a sequence over those at seq_len;
    1.0 without the data's statistics, for a generic card (its FLOPs are traced at one length) or
    a padded candidate."""
    if not cand.padding_free or not settings.row_tokens or arch.generic:
        return 1.0
    real = min(float(settings.row_tokens), float(cand.seq_len))
    worst = step_flops(arch, cand, method, settings=settings)
    return step_flops(arch, cand, method, settings=settings, seq_len=real) / worst if worst > 0 else 1.0


def padding_free_time(
    arch: ModelArch,
    cand: Candidate,
    method: str,
    settings: Settings,
    est: Any,
    terms: dict[str, float],
) -> None:
    """Price the estimate's compute (`est.time_breakdown`, and the roofline's `terms`) at the worst
    case, keep that step's seconds in `est.step_time_worst_case_s`, then scale the compute to the
    data's rows, in place, and say so in `est.notes` (`est`: core.Estimate). The calibration and the
    CPU's modelled step price the padding_free row itself (its compute key; `costs.step_flops`);
    the GPU roofline (`terms`) prices the padded batch's operations, so its compute is first scaled
    by the worst-case row's model FLOPs over the padded batch's (the row's T x T attention)."""
    breakdown = est.time_breakdown
    if terms and not arch.generic:
        padded = step_flops(arch, dataclasses.replace(cand, padding_free=False), method, settings=settings)
        _scale(breakdown, terms, step_flops(arch, cand, method, settings=settings) / padded if padded > 0 else 1.0)
    est.step_time_worst_case_s = round(sum(breakdown.values()), 6)
    scale = padding_free_scale(arch, cand, method, settings)
    if scale == 1.0:
        est.notes.append(
            "padding_free: step time priced on sequences of seq_len tokens, the worst case (no data "
            "statistics given: the workflow prices the rows' own tokens from the prepared data's stats.json)"
        )
        return
    worst = breakdown["compute"]
    _scale(breakdown, terms, scale)
    est.notes.append(
        f"padding_free: compute priced on the data's {settings.row_tokens:g} tokens a sequence, "
        f"x{scale:.3f} of the worst case of {cand.seq_len} tokens ({worst:.4g} s), what its probe runs"
    )


def _scale(breakdown: dict[str, float], terms: dict[str, float], factor: float) -> None:
    breakdown["compute"] *= factor
    for k in terms:
        terms[k] *= factor
