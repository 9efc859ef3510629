"""Step time from a calibration measured on the machine (memfit.train.calibrate writes it).

A calibration holds, for the model with 1 and with n decoder layers (n = min(layers, 4); also L, the model whole,
where that is cheap: memfit.train.calibrate.depths), the seconds of one micro
step's computation at each batch shape (`compute`, on a ZeRO-0 engine) and, per DeepSpeed
engine, what its runtime adds (`runtime`: `micro` per micro step, `boundary` once per optimizer
step, `ref` per micro step for a ZeRO-3 DPO reference). A candidate of a model with L layers
(gradient accumulation G) is priced as

    step = G x (compute(L) + micro(L) + ref(L)) + boundary(L),
    x(L) = x(1) + (L - 1) x (x(n) - x(1)) / (n - 1)     for every measured x,

i.e. every term is affine in the number of identical decoder layers (the embedding, head, loss
and the optimizer step over them are the 1-layer figure less one layer; the same decomposition
memfit.estimate.trace.trace uses for memory). The terms add: on the CPU accelerator DeepSpeed's
collectives run on the compute thread (gloo has no streams to overlap with: `overlap_comm` is a
no-op there), so nothing of a step overlaps. On a GPU with `overlap_comm`, DeepSpeed overlaps
ZeRO-2/3's gradient reduce with the backward (stage_1_and_2.py `reduce_ipg_grads` on the
reduction stream); there the sum bounds the step from above.

When the search space offloads the optimizer, the file also holds `cpu_adam`: DeepSpeedCPUAdam's
parameters per second on one rank's threads, every rank stepping at once (`cpu_adam`); the modelled
step (memfit.estimate.time.costs) prices an offloaded optimizer step from it on that GPU's machine.

A calibration belongs to what it measured (issue #41): the file records the model (`model`: its
name, depth and a SHA-256 of its layer shape, `model_identity`), the device (`device_name`,
`device_total_bytes`: memfit.train.device_info), the world size and the backend. `refusal` says why
it does not price an estimate of another model shape, GPU, world size or backend, and the estimator
falls back to the modelled step time with that reason in `time_source`. Another depth of the same
layer shape is priced by the affine layer model above, and the label says so. A file recorded
before these fields existed is refused the same way ("recorded before ...: re-run calibrate").
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.estimate.memory.method_terms import reference_model
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.time import device_match
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

    def label(self, num_layers: int | None = None) -> str:
        """Where a priced step time comes from; with `num_layers` other than the model measured,
        the depth it was scaled to."""
        m = self.meta
        out = (
            f"measured {m.get('measured_on', '?')[:10]} on {m.get('device', '?')}, "
            f"{m.get('world_size', '?')} ranks x {m.get('threads_per_rank', '?')} threads ({m.get('backend', '?')})"
        )
        measured = (m.get("model") or {}).get("num_layers") if isinstance(m.get("model"), dict) else None
        if num_layers is not None and measured is not None and measured != num_layers:
            out += f", scaled from {measured} to {num_layers} decoder layers (per-layer figures)"
        return out


# Fields of a model card that do not change what one decoder layer costs: names and sources, the
# depth (priced per layer, above), the context length a config allows, and per-layer lists.
_NOT_SHAPE = ("name", "source", "hf_repo", "aliases", "num_layers", "max_position_embeddings", "layer_kind")
_NOT_SHAPE += ("dense_layer_mask", "hf_config", "score_head")
# Keys of a generic card's config.json (`hf_config`) that are depth, provenance or dtype, not shape.
_NOT_SHAPE_HF = ("num_hidden_layers", "layer_types", "_name_or_path", "transformers_version", "architectures")
_NOT_SHAPE_HF += ("torch_dtype", "dtype", "max_position_embeddings", "use_cache")


def model_identity(arch: ModelArch) -> dict[str, Any]:
    """What a calibration records of its model: name, depth, the layer shape and its SHA-256."""
    shape = {k: v for k, v in dataclasses.asdict(arch).items() if k not in _NOT_SHAPE}
    if arch.hf_config:
        hf = json.loads(arch.hf_config)
        shape["hf_config"] = {k: v for k, v in sorted(hf.items()) if k not in _NOT_SHAPE_HF}
    canonical = json.dumps(shape, sort_keys=True, separators=(",", ":"), default=str)
    return {
        "name": arch.name,
        "num_layers": arch.num_layers,
        "shape_sha256": hashlib.sha256(canonical.encode()).hexdigest(),
        "shape": json.loads(canonical),
    }


def refusal(cal: StepTimeCalibration, arch: ModelArch, gpu: str, world: int) -> str | None:
    """Why `cal` does not price a step of `arch` on `world` ranks of `gpu` (a catalog name): it
    measured another model shape, device, world size or backend, or it predates those records."""
    m = cal.meta
    if not isinstance(m.get("model"), dict) or "device_name" not in m:
        return (
            f"the calibration {cal.path} was recorded before memfit recorded the model and device it "
            "measured: re-run calibrate (delete the file; the workflow measures it again)"
        )
    ours = model_identity(arch)
    theirs = m["model"]
    shape = theirs.get("shape") if isinstance(theirs.get("shape"), dict) else {}
    # a reward model is the calibrated causal LM with a score head instead of the vocabulary head
    # (method_terms.method_arch unties it): the calibration measured its steps on that model
    # (memfit.train.calibrate builds the reward model from it), so its head's tying is not compared
    head = ("tie_word_embeddings",) if arch.score_head else ()
    differ = [f"{k} {shape.get(k)!r} vs {v!r}" for k, v in ours["shape"].items() if shape.get(k) != v and k not in head]
    if differ if head else theirs.get("shape_sha256") != ours["shape_sha256"]:
        return (
            f"the calibration {cal.path} measured another model, {theirs.get('name', '?')}, not {arch.name} "
            f"({'; '.join(differ[:3]) or 'another layer shape'}): re-run calibrate for this model"
        )
    depths = m.get("layers")
    if isinstance(depths, list) and len(depths) == 1 and depths[0] != arch.num_layers:
        # a model of at most 4 layers is measured whole only (memfit.train.calibrate.depths): no
        # per-layer figure to scale to another depth
        return (
            f"the calibration {cal.path} measured {theirs.get('name', '?')} whole at {depths[0]} decoder layers "
            f"only, not {arch.num_layers}: re-run calibrate for this model"
        )
    why = device_match.mismatch(m.get("device_name"), m.get("device_total_bytes"), gpu)
    if why:
        return f"the calibration {cal.path} {why}: re-run calibrate on the {gpu}"
    if m.get("world_size") != world:
        return f"the calibration ran {m.get('world_size')} ranks, not {world}"
    backend = "gloo" if gpu == device_match.CPU else "nccl"  # memfit.train.dist: gloo on the CPU, NCCL on GPUs
    if m.get("backend") != backend:
        return f"the calibration ran the {m.get('backend')} backend, not {backend}"
    return None


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
    adam = d.get("cpu_adam")
    if adam is not None:
        rate = adam.get("params_per_s_per_rank") if isinstance(adam, dict) else None
        if not isinstance(rate, int | float) or isinstance(rate, bool) or not 0 < rate < 1e13:
            raise CalibrationFileError(
                f"{path}: cpu_adam.params_per_s_per_rank must be a positive rate in parameters per second, "
                f"got {rate!r}: measure it again (delete the file; the calibrate rule writes it)"
            )
    meta = {k: v for k, v in d.items() if k not in ("compute", "runtime")}
    return StepTimeCalibration(path, d["compute"], d["runtime"], meta)


def cpu_adam(cal: StepTimeCalibration, gpu: str) -> dict[str, Any] | None:
    """The DeepSpeedCPUAdam rate `cal` measured (memfit.train.calibrate: every rank at once, on its
    own threads) if it has one and was measured on a `gpu` machine; else None. It is the host's
    rate per parameter, so another model shape than the one calibrated keeps it."""
    m = cal.meta
    if not isinstance(m.get("cpu_adam"), dict) or "device_name" not in m:
        return None
    if device_match.mismatch(m.get("device_name"), m.get("device_total_bytes"), gpu):
        return None
    return m["cpu_adam"]


def cpu_adam_label(cal: StepTimeCalibration, adam: dict[str, Any]) -> str:
    """What `Estimate.time_source` says of a measured DeepSpeedCPUAdam rate."""
    return (
        f"DeepSpeedCPUAdam at {adam['params_per_s_per_rank']:.3g} params/s per rank (measured by calibrate "
        f"{str(cal.meta.get('measured_on', '?'))[:10]} on {cal.meta.get('device', '?')}: "
        f"{adam.get('block_params', 0):,} fp32 parameters, {adam.get('threads_per_rank', '?')} thread(s) a rank, "
        f"{cal.path})"
    )


def _at(fig: dict[str, float], layers: int) -> float:
    """The figure of a model with `layers` decoder layers from its measured depths (1 and n; a
    1-layer model's calibration has only the first): linear between the two measured depths that
    bracket `layers`, beyond the deepest along the last two. A calibration that also measured the
    model whole (memfit.train.calibrate.depths) is exact at its depth: extrapolating the 24-layer
    GPU demo from 1 and 4 layers priced its ZeRO-0 steps 1.6-2.0x long on an H200 (issue #42,
    benchmarks/replay_h200_calibration.py)."""
    pts = sorted((int(k), float(v)) for k, v in fig.items())
    if len(pts) == 1:
        return pts[0][1]
    (n0, x0), (n1, x1) = next(
        ((a, b) for a, b in zip(pts, pts[1:], strict=False) if layers <= b[0]), (pts[-2], pts[-1])
    )
    return x0 + (layers - n0) * (x1 - x0) / (n1 - n0)


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
    ref = max(_at(rt["ref"], num_layers), 0.0) if (reference_model(cand, method) and "ref" in rt) else 0.0
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
