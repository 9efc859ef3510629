"""Step time from a calibration measured on the machine (memfit.train.calibrate writes it).

A calibration holds, for the model with 1 and with n decoder layers (n = min(layers, 4)), the seconds of one micro
step's computation at each batch shape (`compute`, on a ZeRO-0 engine) and, per DeepSpeed
engine, what its runtime adds (`runtime`: `micro` per micro step, `boundary` once per optimizer
step, `ref` per micro step for a ZeRO-3 DPO reference). A candidate of a model with L layers
(gradient accumulation G) is priced as

    step = G x (compute(L) + micro(L) + ref(L)) + boundary(L),
    x(L) = x(1) + (L - 1) x (x(n) - x(1)) / (n - 1)     for every measured x,

i.e. every term is affine in the number of identical decoder layers (the embedding, head, loss
and the optimizer step over them are the 1-layer figure less one layer; the same decomposition
memfit.estimate.trace uses for memory). The terms add: on the CPU accelerator DeepSpeed's
collectives run on the compute thread (gloo has no streams to overlap with: `overlap_comm` is a
no-op there), so nothing of a step overlaps. On a GPU with `overlap_comm`, DeepSpeed overlaps
ZeRO-2/3's gradient reduce with the backward (stage_1_and_2.py `reduce_ipg_grads` on the
reduction stream); there the sum bounds the step from above.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.space import Candidate, compute_key, engine_key

FORMAT = 1  # memfit.train.calibrate.FORMAT of the files this reads


class CalibrationFileError(ValueError):
    """A step-time calibration file that cannot be used (names the file and what is wrong)."""


@dataclass(frozen=True)
class StepTimeCalibration:
    path: str
    compute: dict[str, dict[str, float]]  # compute_key -> {"1": s, "<n>": s}
    runtime: dict[str, dict[str, dict[str, float]]]  # engine_key -> {micro|boundary|ref: {"1": s, "<n>": s}}
    meta: dict[str, Any]  # measured_on, device, world_size, threads_per_rank, backend, versions

    def label(self) -> str:
        m = self.meta
        return (
            f"measured {m.get('measured_on', '?')[:10]} on {m.get('device', '?')}, "
            f"{m.get('world_size', '?')} ranks x {m.get('threads_per_rank', '?')} threads ({m.get('backend', '?')})"
        )


def load(path: str | Path) -> StepTimeCalibration:
    p = Path(path)
    return _load(str(p), p.stat().st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _load(path: str, _mtime_ns: int) -> StepTimeCalibration:
    try:
        d = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise CalibrationFileError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        got = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise CalibrationFileError(f"{path}: step-time calibration format {got!r}, expected {FORMAT}: measure it again")
    for part in ("compute", "runtime"):
        if not isinstance(d.get(part), dict):
            raise CalibrationFileError(f"{path}: missing the {part!r} table")
    meta = {k: v for k, v in d.items() if k not in ("compute", "runtime")}
    return StepTimeCalibration(path, d["compute"], d["runtime"], meta)


def _at(fig: dict[str, float], layers: int) -> float:
    """The figure of a model with `layers` decoder layers from its 1- and n-layer measurements
    (a 1-layer model's calibration has only the first)."""
    n = max(int(k) for k in fig)
    one = float(fig["1"])
    return one if n == 1 else one + (layers - 1) * (float(fig[str(n)]) - one) / (n - 1)


def missing(cal: StepTimeCalibration, cand: Candidate, method: str) -> str | None:
    """Why `cand` cannot be priced from `cal` (the measurement it lacks), or None."""
    if cand.sequence_parallel > 1:  # memfit.train.calibrate.plan: its engines build no Ulysses groups
        return "the calibration does not measure sequence-parallel engines"
    if compute_key(method, cand) not in cal.compute:
        return f"no computation measured for {compute_key(method, cand)}"
    if engine_key(cand) not in cal.runtime:
        return f"no engine measured for {engine_key(cand)}"
    return None


def predict(cal: StepTimeCalibration, cand: Candidate, method: str, num_layers: int) -> dict[str, float]:
    """Seconds per optimizer step by term: compute, deepspeed (per micro step beyond the
    computation, all micro steps), reference (ZeRO-3 reference gathers), boundary (the
    optimizer step and what the boundary micro step adds). Raises KeyError when a measurement
    is missing (`missing` says which)."""
    rt = cal.runtime[engine_key(cand)]
    g = cand.grad_accum
    # a runtime cost measured below zero is measurement noise around nothing: priced as 0
    micro = max(_at(rt["micro"], num_layers), 0.0)
    ref = max(_at(rt["ref"], num_layers), 0.0) if (method == "dpo" and cand.ref == "model" and "ref" in rt) else 0.0
    return {
        "compute": g * _at(cal.compute[compute_key(method, cand)], num_layers),
        "deepspeed": g * micro,
        "reference": g * ref,
        "boundary": max(_at(rt["boundary"], num_layers), 0.0),
    }


def _ranks(xs: list[float]) -> list[float]:
    """1-based ranks, ties given their mean rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of paired values: Pearson's correlation of their ranks
    (Spearman 1904), ties at mean rank; nan with fewer than 2 pairs or a constant side."""
    if len(a) != len(b):
        raise ValueError(f"spearman: {len(a)} values against {len(b)}")
    if len(a) < 2:
        return float("nan")
    ra, rb = _ranks(list(a)), _ranks(list(b))
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return cov / (va * vb) ** 0.5 if va and vb else float("nan")
