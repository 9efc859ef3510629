"""A step priced on the prepared data's rows rather than on rows of seq_len tokens (docs/speed.md).

Every candidate's probe runs the worst case, every sequence seq_len tokens (memfit.train.batches
`probe_rows`, `padding_free_batch`, `dpo_padding_free_batch`, padded by `pad_to`), and the
calibration measures that shape (space.compute_key). Training computes less:

- a padding_free candidate the rows' own tokens: its compute is scaled to the data's mean tokens
  per sequence (`Settings.row_tokens`, prepare_data's stats.json `length.mean`);
- a padded candidate pads each micro batch only to its longest row (memfit.train.batches.collate,
  `pad_to` None in training): its compute is scaled to the expected longest row of a micro batch
  (`expected_longest`, from `Settings.row_length_quantiles`, stats.json `length.quantiles`).

Both by the model FLOPs at those lengths over those at seq_len (`costs.step_flops`: under eager a
padding_free row's attention covers the whole row, T x T, masked; flash-attention's varlen kernel
and memfit's per-sequence sdpa each sequence's own square). The worst case is kept (`Estimate.step_time_worst_case_s`): a
probe compares with it (memfit.workflow.probe), and the selection scales a measured probe by the
same ratio (memfit.estimate.selection). Without the data's statistics, or for SFT packing (packs
fill to seq_len: the workflow passes no statistics, memfit.workflow.pipeline), the worst case is
the price; a padded candidate's estimate is then what it was.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from memfit.estimate.models.arch import ModelArch
from memfit.estimate.settings import Settings
from memfit.estimate.time.costs import step_flops
from memfit.space import Candidate


def expected_longest(quantiles: Sequence[float], n: int) -> float:
    """E[max of n independent draws] of a length whose quantiles at u = 0, 1/K, ..., 1 are
    `quantiles` (K + 1 values, nondecreasing). The maximum of n draws has the distribution F^n
    (David & Nagaraja, Order Statistics, 3rd ed. 2003, sec. 2.1), so E[max] = integral over
    [0, 1] of F^-1(u) d(u^n), here with F^-1 linear between the grid's points, integrated exactly
    on each interval [a, b]: q_a (b^n - a^n) + slope (n/(n+1) (b^(n+1) - a^(n+1)) - a (b^n - a^n)).
    n = 1 gives the mean of that F^-1."""
    k = len(quantiles) - 1
    if k < 1 or n < 1:
        raise ValueError(f"expected_longest: needs 2 or more quantiles and n >= 1, got {k + 1} and n={n}")
    total = 0.0
    for i in range(k):
        a, b, qa = i / k, (i + 1) / k, float(quantiles[i])
        slope = (float(quantiles[i + 1]) - qa) * k
        total += qa * (b**n - a**n) + slope * (n / (n + 1) * (b ** (n + 1) - a ** (n + 1)) - a * (b**n - a**n))
    return total


def data_tokens(cand: Candidate, settings: Settings) -> tuple[float, str] | None:
    """Tokens a sequence one rank computes in training, and how they were found; None where the
    estimate prices the worst case (no statistics for this lever). `cand`: the rank's share
    (core.per_rank: seq_len / sequence_parallel)."""
    if cand.padding_free:
        if not settings.row_tokens:
            return None
        return min(
            float(settings.row_tokens), float(cand.seq_len)
        ), f"the data's {settings.row_tokens:g} tokens a sequence"
    if not settings.row_length_quantiles:
        return None
    # the rows one padded forward pads together: the micro batch's rows. A row's `length` is the
    # longest sequence collate builds from it (a pair: the prompt and the longer response, and
    # collate pads chosen and rejected together; KTO: the longer of the row and its KL
    # completion, which run as two forwards, so a little above either), so the forward's longest
    # sequence is the longest row of micro_batch draws
    longest = expected_longest(settings.row_length_quantiles, cand.micro_batch)
    how = f"the expected longest row of {cand.micro_batch} from the data's lengths, {longest:.1f} tokens"
    if cand.sequence_parallel > 1:  # a rank computes its share of each sequence (core.per_rank)
        how += f" ({longest / cand.sequence_parallel:.1f} a rank of {cand.sequence_parallel})"
    return min(longest / cand.sequence_parallel, float(cand.seq_len)), how


def data_scale(arch: ModelArch, cand: Candidate, method: str, settings: Settings) -> float:
    """The step's model FLOPs at the tokens a sequence training computes (`data_tokens`) over
    those at seq_len; 1.0 without the data's statistics or for a generic card (its FLOPs are
    traced at one length)."""
    real = data_tokens(cand, settings)
    if real is None or arch.generic:
        return 1.0
    worst = step_flops(arch, cand, method, settings=settings)
    return step_flops(arch, cand, method, settings=settings, seq_len=real[0]) / worst if worst > 0 else 1.0


def data_time(
    arch: ModelArch,
    cand: Candidate,
    method: str,
    settings: Settings,
    est: Any,
    terms: dict[str, float],
) -> None:
    """Price the estimate's compute (`est.time_breakdown`, and the roofline's `terms`) at the worst
    case, keep that step's seconds in `est.step_time_worst_case_s`, then scale the compute to the
    data's rows, in place, and say so in `est.notes` (`est`: core.Estimate). A padded candidate
    without the data's lengths is left as it was (no worst case kept). The calibration and the
    CPU's modelled step price the padding_free row itself (its compute key; `costs.step_flops`);
    the GPU roofline (`terms`) prices the padded batch's operations, so a padding_free candidate's
    compute is first scaled by the worst-case row's model FLOPs over the padded batch's (eager: the
    row's T x T attention; 1 otherwise)."""
    lever = "padding_free" if cand.padding_free else "padded"
    real = data_tokens(cand, settings)
    if not cand.padding_free and real is None:
        return
    breakdown = est.time_breakdown
    if cand.padding_free and terms and not arch.generic:
        padded = step_flops(arch, dataclasses.replace(cand, padding_free=False), method, settings=settings)
        _scale(breakdown, terms, step_flops(arch, cand, method, settings=settings) / padded if padded > 0 else 1.0)
    est.step_time_worst_case_s = round(sum(breakdown.values()), 6)
    if real is None or arch.generic:
        why = "a generic card's FLOPs are traced at seq_len" if real is not None else "no data statistics given"
        est.notes.append(
            f"{lever}: step time priced on sequences of seq_len tokens, the worst case ({why}: the "
            "workflow prices the rows' own tokens from the prepared data's stats.json)"
        )
        return
    scale = data_scale(arch, cand, method, settings)
    worst = breakdown["compute"]
    _scale(breakdown, terms, scale)
    est.notes.append(
        f"{lever}: compute priced on {real[1]}, x{scale:.3f} of the worst case of {cand.seq_len} "
        f"tokens ({worst:.4g} s), what its probe runs"
    )


def _scale(breakdown: dict[str, float], terms: dict[str, float], factor: float) -> None:
    breakdown["compute"] *= factor
    for k in terms:
        terms[k] *= factor
