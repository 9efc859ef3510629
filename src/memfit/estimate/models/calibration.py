"""Per-GPU calibration of the estimator's device terms: measured, or today's stated heuristics.

A calibration file `config/calibration/<gpu>.json` (written by
`benchmarks/gpu_evidence.py --write-calibration` from a finished evidence JSON) replaces the
heuristics of `memfit.estimate.memory.overheads.device_overheads` and the step-time efficiency with values
measured on that GPU. Without a file, `for_gpu` returns the uncalibrated defaults, which are
exactly the values the estimator used before calibration existed (sources cited per field).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.units import MIB

CALIBRATION_DIR = Path(__file__).resolve().parents[4] / "config" / "calibration"
# step: model FLOPs / measured step time; matmul: one 8192^3 GEMM; gemm: the median of a training
# step's GEMM shapes (memfit.estimate.time.roofline); attention: causal SDPA
KERNEL_CLASSES = ("step", "matmul", "gemm", "attention")
UNCALIBRATED = "uncalibrated (stated heuristics)"


class CalibrationError(ValueError):
    """A calibration file that is missing a key or holds an impossible value."""


@dataclass(frozen=True)
class Calibration:
    device: str  # catalog GPU name this calibration is for
    cuda_context_bytes: int  # device memory of the CUDA context (nvidia-smi minus reserved)
    # device memory beyond the allocator's reserved bytes that the first GEMM adds (the cuBLAS
    # handle's state and the kernel images CUDA's lazy module loading brings in); the workspaces
    # themselves are allocated tensors (`allocator_workspace_bytes`)
    cublas_workspace_bytes: int
    # NCCL buffers per peer rank and their cap (world > 1), where the calibration measured them;
    # None: the estimator's NCCL figures (memfit.estimate.memory.overheads.device_overheads) stand
    nccl_bytes_per_peer: int | None = None
    nccl_max_bytes: int | None = None
    # what nvidia-smi shows of a one-rank memfit run beyond reserved + context + cuBLAS (the rank
    # still creates an NCCL communicator: memfit's trainer all-reduces its metrics and peaks);
    # None: not measured, the estimator counts no NCCL at one rank
    single_rank_extra_bytes: int | None = None
    # reserved/allocated - 1 at the peak, as measured; kept for the record: the estimator's reserved
    # comes from the allocator's mechanisms (memfit.estimate.memory.allocator), not from this ratio
    fragmentation: float | None = None
    # the share of the fp32 logits block the caching allocator keeps cached beyond the loss
    # backward's allocated peak (allocator.LOGITS_CACHED_SHARE); None: that default
    logits_cached_share: float | None = None
    # the device-memory margin selection keeps free when the user states no headroom: derived from
    # the spread of memfit's own device-total error on this GPU (`margin_for`); None: the default
    device_margin: float | None = None
    # what the caching allocator holds after a forward and backward GEMM with every tensor freed:
    # the cuBLAS workspaces (one per handle and stream, `allocator_workspaces`); None: that default
    allocator_workspace_bytes: int | None = None
    hbm_gbs: float | None = None  # device memory bandwidth, GB/s (a device-to-device copy); None: the vendor's
    tflops: dict[str, float] = field(default_factory=dict)  # achieved TFLOP/s per kernel class
    measured_on: str = ""  # "" (uncalibrated) or the ISO date of the measurement
    measured_device: str = ""  # torch.cuda.get_device_name of the measured GPU
    source: str = ""  # the evidence JSON the values come from

    @property
    def measured(self) -> bool:
        return bool(self.measured_on)

    def label(self) -> str:
        """What `Estimate.calibration` says."""
        if self.measured:
            return f"measured {self.measured_on} on {self.measured_device or self.device}"
        return UNCALIBRATED

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def default_for(gpu_name: str, compute_capability: str) -> Calibration:
    """The stated defaults of a GPU without a calibration file:
    - CUDA context with lazy module loading (CUDA >= 11.7): measured on Hopper (HOPPER_CONTEXT_BYTES,
      the same on the H100 and the H200); 500 MiB on sm80, 400 MiB before (PyTorch docs "CUDA
      semantics: memory management"; mem_get_info deltas in PyTorch issue 20532);
    - one rank's NCCL communicator and other non-torch memory: measured on Hopper
      (HOPPER_SINGLE_RANK_EXTRA_BYTES), none counted before;
    - cuBLAS beside the allocator (its handle and the kernel images lazy module loading brings
      in at the first GEMM; the workspaces are allocated tensors, `allocator_workspaces`):
      69,206,016 bytes on Hopper and newer, measured to the byte on both the H100 (2026-11-26)
      and the H200 (2026-11-27) by gpu_evidence's context stage; 9 MiB before, an unmeasured
      guess kept from the estimator's first version;
    - NCCL: not from these defaults: `estimate.memory.overheads.device_overheads` uses NCCL_CUMEM_BYTES
      plus the NVLS buffers unless a measured calibration file states its own per-peer figures
      (a one-GPU measurement has none);
    - reserved memory: the caching allocator's mechanisms (memfit.estimate.memory.allocator), with its
      default share of the fp32 logits block left cached (`logits_cached_share` None);
    - device margin: UNCALIBRATED_MARGIN (`device_margin` None);
    - tflops: empty = the per-operation roofline (memfit.estimate.time.roofline) assumes the H100's
      measured fractions of this GPU's dense peak for GEMMs and attention."""
    if gpu_name == "cpu":
        return Calibration(gpu_name, 0, 0)
    major = int(str(compute_capability).split(".")[0])
    if major >= 9:
        return Calibration(
            device=gpu_name,
            cuda_context_bytes=HOPPER_CONTEXT_BYTES,
            cublas_workspace_bytes=HOPPER_CUBLAS_OUTSIDE_BYTES,
            single_rank_extra_bytes=HOPPER_SINGLE_RANK_EXTRA_BYTES,
        )
    return Calibration(
        device=gpu_name,
        cuda_context_bytes=500 * MIB if major >= 8 else 400 * MIB,
        cublas_workspace_bytes=9 * MIB,
    )


# The CUDA context of a torch process on Hopper (CUDA 12, lazy module loading): 648,871,936 bytes,
# measured to the byte on an H100 (2026-11-26) and an H200 (2026-11-27) by gpu_evidence's context
# stage (mem_get_info used - memory_reserved after torch.zeros(1)); the 500 MiB of the PyTorch
# docs' range stays for older GPUs
HOPPER_CONTEXT_BYTES = 648_871_936
# nvidia-smi's total of a one-rank memfit run beyond reserved, context and cuBLAS on Hopper (the
# rank's NCCL communicator: memfit's trainer all-reduces its metrics): the median of the H100's 10
# probes, 1,077,084,160 bytes (config/calibration/h100-80gb.json, 2026-11-26; the H200's 5 probes
# measured 1,070,792,704 on 2026-11-27). Not measured before Hopper: none counted there.
HOPPER_SINGLE_RANK_EXTRA_BYTES = 1_077_084_160
# what the first bf16 GEMM adds beside the allocator on an H100 and an H200 alike
# (benchmarks/results/gpu_evidence_h100-80gb.json and _h200.json, stage context)
HOPPER_CUBLAS_OUTSIDE_BYTES = 69_206_016
# PyTorch's cuBLAS workspace per (handle, stream), allocated through the CUDA caching allocator
# (aten/src/ATen/cuda/CublasHandlePool.cpp `getNewWorkspace`, `parseChosenWorkspaceSize`: the
# CUBLAS_WORKSPACE_CONFIG default ":4096:2:16:8", "32MiB for Hopper"; PyTorch 2.11 and 2.13)
HOPPER_WORKSPACE_BYTES = 4096 * 8 * 1024
PRE_HOPPER_WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8  # 8,519,680


def allocator_workspaces(cal: Calibration, compute_capability: str) -> int:
    """Allocated bytes of the cuBLAS workspaces a training step leaves in the caching allocator:
    measured (`allocator_workspace_bytes`), else two per-handle workspaces. cuBLAS handles are per
    host thread (aten/src/ATen/cuda/detail/DeviceThreadHandles.h) and autograd runs the backward
    on a thread of its own per CUDA device (torch/csrc/autograd/engine.cpp, "Allocating GPUs to
    autograd threads"): the forward's GEMMs and the backward's hold one workspace each, never
    freed. Both H100 and H200 probes at ZeRO-0 measured exactly 64 MiB above the tensors
    (benchmarks/results/gpu_evidence_h100-80gb.json, sft-full-z0). PyTorch 2.11 adds 1 MiB per
    handle where cuBLASLt runs (a Linear with a bias), which 2.13 no longer does (its Lt shares the
    workspace): left out. 0 on the `cpu` device."""
    if cal.device == "cpu":
        return 0
    if cal.allocator_workspace_bytes is not None:
        return cal.allocator_workspace_bytes
    major = int(str(compute_capability).split(".")[0])
    return 2 * (HOPPER_WORKSPACE_BYTES if major >= 9 else PRE_HOPPER_WORKSPACE_BYTES)


def validate(d: dict[str, Any], where: str) -> Calibration:
    """A Calibration from a file's dict; errors name the file and the key."""
    if not isinstance(d, dict):
        raise CalibrationError(f"{where}: expected a JSON object, got {type(d).__name__}")
    known = {f.name for f in dataclasses.fields(Calibration)}
    unknown = sorted(set(d) - known - {"_comment", "measurements"})
    if unknown:
        raise CalibrationError(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")
    for k in ("device", "cuda_context_bytes", "cublas_workspace_bytes", "measured_on"):
        if k not in d:
            raise CalibrationError(f"{where}: missing key {k!r}")
    optional = ("nccl_bytes_per_peer", "nccl_max_bytes", "single_rank_extra_bytes", "allocator_workspace_bytes")
    for k in ("cuda_context_bytes", "cublas_workspace_bytes", *optional):
        v = d.get(k, 0)
        if v is None and k in optional:
            continue
        if not isinstance(v, int) or v < 0 or v > 64 * 1024 * MIB:
            raise CalibrationError(f"{where}: {k} must be bytes (int, 0..64 GiB), got {v!r}")
    hbm = d.get("hbm_gbs")
    if hbm is not None and not (isinstance(hbm, (int, float)) and 0 < hbm < 100_000):
        raise CalibrationError(f"{where}: hbm_gbs must be a bandwidth in GB/s (0..100000), got {hbm!r}")
    frag = d.get("fragmentation")
    if frag is not None and not (isinstance(frag, (int, float)) and 0 <= frag < 2):
        raise CalibrationError(f"{where}: fragmentation must be a share in [0, 2), got {frag!r}")
    share = d.get("logits_cached_share")
    if share is not None and not (isinstance(share, (int, float)) and 0 <= share <= 2):
        raise CalibrationError(
            f"{where}: logits_cached_share must be a share of the fp32 logits block in [0, 2], got {share!r}"
        )
    margin = d.get("device_margin")
    if margin is not None and not (isinstance(margin, (int, float)) and 0 <= margin < 0.5):
        raise CalibrationError(
            f"{where}: device_margin must be a fraction of device memory in [0, 0.5), got {margin!r}"
        )
    tflops = d.get("tflops", {})
    if not isinstance(tflops, dict):
        raise CalibrationError(f"{where}: tflops must be an object {{kernel class: TFLOP/s}}")
    for k, v in tflops.items():
        if k not in KERNEL_CLASSES:
            raise CalibrationError(f"{where}: tflops.{k}: unknown kernel class; use {KERNEL_CLASSES}")
        if not isinstance(v, (int, float)) or not 0 < v < 10000:
            raise CalibrationError(f"{where}: tflops.{k} must be a positive TFLOP/s, got {v!r}")
    if not d["measured_on"]:
        raise CalibrationError(f"{where}: measured_on must be the measurement's date")
    kw = {k: v for k, v in d.items() if k in known}
    if (kw.get("nccl_bytes_per_peer") is None) != (kw.get("nccl_max_bytes") is None):
        raise CalibrationError(
            f"{where}: nccl_bytes_per_peer and nccl_max_bytes go together (both measured or neither)"
        )
    kw["tflops"] = {k: float(v) for k, v in tflops.items()}
    return Calibration(**kw)


def load(path: str | Path) -> Calibration:
    p = Path(path)
    return _load_cached(str(p), p.stat().st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _load_cached(path: str, _mtime_ns: int) -> Calibration:
    """Parsed once per file version: the estimator asks for every candidate of a search space."""
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise CalibrationError(f"{p}: not valid JSON: {e}") from None
    return validate(d, str(p))


def for_gpu(gpu_name: str, compute_capability: str, directory: str | Path | None = None) -> Calibration:
    """The measured calibration of `gpu_name` if `config/calibration/<gpu_name>.json` exists,
    else `default_for`. Fields a file leaves out keep the default."""
    path = Path(directory or CALIBRATION_DIR) / f"{gpu_name}.json"
    if not path.exists():
        return default_for(gpu_name, compute_capability)
    cal = load(path)
    if cal.device != gpu_name:
        raise CalibrationError(f"{path}: device is {cal.device!r}, expected {gpu_name!r}")
    return cal


# The device-memory margin selection keeps free when the user states no headroom (issue #42): the
# worst under-prediction of nvidia-smi's device total measured on the GPU's evidence rows
# (benchmarks/bench_reserved.py prints it per GPU and path) plus MARGIN_SAFETY for what a probe
# of a few steps does not show: nvidia-smi's 0.1 s polls can miss a short spike, and a longer run
# meets more batch shapes than the probes' padded ones.
MARGIN_SAFETY = 0.02
# uncalibrated: the worst device-total under-prediction of the H100 and H200 rows estimated without
# their calibration files (-4.9%, h100-80gb sft-qlora-z0-gc: the allocator's mechanisms with the
# default LOGITS_CACHED_SHARE 0.5, benchmarks/bench_reserved.py, 2026-11-27), plus MARGIN_SAFETY,
# rounded up to a whole percent. No memfit run on an older GPU has been measured: the figure is the
# Hopper rows', the only evidence of memfit's own trainer.
UNCALIBRATED_MARGIN = 0.07


def margin_for(worst_under: float) -> float:
    """The margin from a measured worst device-total error (negative: under-predicted): its size
    plus MARGIN_SAFETY, rounded up to a whole percent."""
    import math

    return math.ceil((max(-worst_under, 0.0) + MARGIN_SAFETY) * 100 - 1e-9) / 100


def device_margin(cal: Calibration) -> tuple[float, str]:
    """(fraction of device memory to keep free, where it comes from) when no headroom is given."""
    if cal.measured and cal.device_margin is not None:
        return cal.device_margin, f"derived: memfit's device-total error measured {cal.measured_on} on {cal.device}"
    return UNCALIBRATED_MARGIN, "derived: memfit's uncalibrated device-total error on the H100 and H200 rows"
