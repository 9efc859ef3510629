"""memfit's step time against published GPU training throughput (`tests/public_throughput.yaml`).

Each row is one training run someone else timed on real GPUs, with its setting and the figure
as printed. memfit_validation.step_time_cases loads the table and maps each row to an estimator call; `compare` runs `memfit.estimate.estimate` (per-node
GPUs = num_gpus / num_nodes) and converts its `step_time_s` to the row's published unit:

    tokens_per_s_per_gpu = global_batch * seq_len / (step_time_s * num_gpus)
    seconds_per_step     = step_time_s
    mfu_pct              = flops_per_token * tokens_per_s_per_gpu / peak (the source's own
                           definition; only where it is known: `MFU_DEFINITIONS`)

The error is `predicted / published - 1` in that unit, `time_error` the same on seconds per step
(negative: predicted faster). A row with only `throughput_unitless` or `gpu_mismatch` (not the
catalog GPU) is compared for ORDER only: `sweep_order` counts a sweep's pairs ordered as published.

Every GPU time here is memfit's modelled step (`costs.step_time`: rooflines plus `runtime_costs`;
a stage-0 row runs DeepSpeed's engine only where its framework names DeepSpeed, `zero0_engine`), no
calibration. A row memfit cannot represent is `not_comparable`, with the reason: never approximated.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memfit.estimate import Estimate

from memfit_validation.step_time_cases import METRIC_IS_RATE, MFU_DEFINITIONS, Row, Sweep, predict, published_tie

# ------------------------------------------------------------------------------ comparison


@dataclass(frozen=True)
class Result:
    row: Row
    est: Estimate
    step_time_s: float  # est.step_time_s
    tokens_per_s_per_gpu: float  # predicted: global_batch * seq_len / (step_time_s * num_gpus)
    dominant: str  # largest term of est.time_breakdown
    predicted: float | None = None  # in row.unit (None: order only)
    published: float | None = None
    error: float | None = None  # predicted / published - 1, in row.unit
    time_error: float | None = None  # predicted / published seconds per step - 1 (negative: predicted faster)
    mfu_predicted: float | None = None  # percent, the source's definition (MFU_DEFINITIONS)
    mfu_published: float | None = None

    def metric(self, metric: str) -> float:
        """The prediction in a sweep's metric (a unitless throughput as tokens/s/GPU: within one
        source and sweep the rows share seq_len and GPU count, so samples/s orders the same)."""
        return self.step_time_s if metric == "seconds_per_step" else self.tokens_per_s_per_gpu


def compare(row: Row) -> Result | None:
    """The row's prediction in its published unit; None when the row is not comparable."""
    if row.not_comparable:
        return None
    e, unit = predict(row), row.unit
    tokens = row.global_batch * row.seq_len
    tps = tokens / (e.step_time_s * row.num_gpus)
    terms = {k: v for k, v in e.time_breakdown.items() if v > 0}
    dominant = max(terms, key=terms.get) if terms else ""
    res = Result(row=row, est=e, step_time_s=e.step_time_s, tokens_per_s_per_gpu=tps, dominant=dominant)
    if unit:
        pub = row.published[unit]
        pub_step = pub if unit == "seconds_per_step" else tokens / (pub * row.num_gpus)
        pred = tps if unit == "tokens_per_s_per_gpu" else e.step_time_s
        res = dataclasses.replace(
            res, predicted=pred, published=pub, error=pred / pub - 1, time_error=e.step_time_s / pub_step - 1
        )
    mfu = next((v for k, v in MFU_DEFINITIONS.items() if row.framework.startswith(k)), None)
    if unit and mfu and "mfu_pct" in row.published and row.gpu in mfu[1]:
        flops, peak = mfu[0](row.arch, row.seq_len), mfu[1][row.gpu]
        res = dataclasses.replace(res, mfu_predicted=100 * flops * tps / peak, mfu_published=row.published["mfu_pct"])
    return res


def compare_all(rows: Iterable[Row]) -> dict[str, Result]:
    return {r.id: res for r in rows if (res := compare(r)) is not None}


@dataclass(frozen=True)
class SweepResult:
    sweep: Sweep
    pairs: int  # pairs compared (neither a published tie nor a row memfit cannot predict)
    agree: int  # of those, predicted in the published order
    tied: int  # pairs skipped as published ties
    missing: tuple[str, ...]  # rows of the sweep memfit cannot predict
    wrong: tuple[tuple[str, str], ...]  # (published faster, slower) pairs predicted the other way or equal

    @property
    def share(self) -> float | None:
        return self.agree / self.pairs if self.pairs else None


def sweep_order(sweep: Sweep, results: Mapping[str, Result]) -> SweepResult:
    """Pairwise order agreement of one sweep: for every pair (a before b in published_order, a
    published faster) not listed in `ties`, does memfit predict a strictly faster?"""
    pairs = list(itertools.combinations(sweep.order, 2))
    tied = sum(published_tie(sweep, a, b) for a, b in pairs)
    pairs = [(a, b) for a, b in pairs if not published_tie(sweep, a, b) and a in results and b in results]
    rate = METRIC_IS_RATE[sweep.metric]
    pred = {i: results[i].metric(sweep.metric) for pair in pairs for i in pair}
    wrong = tuple((a, b) for a, b in pairs if not (pred[a] > pred[b] if rate else pred[a] < pred[b]))
    missing = tuple(r for r in sweep.order if r not in results)
    return SweepResult(sweep, len(pairs), len(pairs) - len(wrong), tied, missing, wrong)


@dataclass(frozen=True)
class Summary:
    n_absolute: int  # rows compared in a published unit
    median_abs_error: float  # over those, in the published unit
    median_abs_time_error: float  # over those, on seconds per step
    n_order_only: int  # rows compared for order only, within their sweeps
    not_compared: tuple[tuple[str, str], ...]  # (row id, why): not comparable, or order-only in no sweep
    pairs: int
    agree: int

    @property
    def order_share(self) -> float | None:
        return self.agree / self.pairs if self.pairs else None


def not_compared_reason(row: Row) -> str:
    """Why the row enters neither the error nor an order ("" when it enters one)."""
    if row.not_comparable or row.unit or row.sweeps:
        return row.not_comparable
    return f"order only ({row.order_only}) and in no sweep"


def summarize(rows: Iterable[Row], results: Mapping[str, Result], sweeps: Iterable[SweepResult]) -> Summary:
    absolute = [r for r in results.values() if r.predicted is not None]
    sw = list(sweeps)
    return Summary(
        n_absolute=len(absolute),
        median_abs_error=statistics.median(abs(r.error) for r in absolute) if absolute else math.nan,
        median_abs_time_error=statistics.median(abs(r.time_error) for r in absolute) if absolute else math.nan,
        n_order_only=sum(r.predicted is None and bool(r.row.sweeps) for r in results.values()),
        not_compared=tuple((r.id, why) for r in rows if (why := not_compared_reason(r))),
        pairs=sum(s.pairs for s in sw),
        agree=sum(s.agree for s in sw),
    )
