"""What a configuration holds besides its tensors: memory nvidia-smi shows that no tensor holds
(CUDA context, cuBLAS, NCCL), the caching allocator's fragmentation, and host RAM per node. The
numbers are stated heuristics, each with its source (the step's time: memfit.estimate.time.costs)."""

from __future__ import annotations

from dataclasses import dataclass

from memfit.estimate.memory.states import ModelStates
from memfit.estimate.models import calibration
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.models.catalog import GPU
from memfit.estimate.models.params import param_layout, trainable_params
from memfit.estimate.settings import DEFAULT_SETTINGS, Settings, dtype_bytes
from memfit.space import Candidate
from memfit.units import CHECKPOINT_CHUNK_BYTES, GIB

# NCCL's device memory per GPU process once a communicator exists. NCCL >= 2.19 allocates its
# buffers with cuMem by default (NCCL docs, "Environment variables: NCCL_CUMEM_ENABLE"; quoted in
# vllm-project/vllm PR #5091); vLLM's memory profiler measured 1.79 GiB of non-torch memory for
# one H100 process and 3.58 GiB for each of two tensor-parallel processes (vllm-project/vllm
# PR #10511, Meta-Llama-3-8B, -tp 1 vs -tp 2): the communicator adds 1.79 GiB per process. An
# outside measurement, not fitted to memfit's validation table. On NVSwitch systems NCCL also
# maps NVLink-SHARP buffers (`NCCL_NVLS_BYTES_PER_GPU` below). `Settings.nccl_bytes` replaces
# both (e.g. NCCL_CUMEM_ENABLE=0, NCCL_NVLS_ENABLE=0 and a smaller NCCL_BUFFSIZE); a measured
# calibration file (config/calibration/) keeps its own NCCL values.
NCCL_CUMEM_BYTES = int(1.79 * GIB)

# NCCL's NVLink SHARP (NVLS) buffers, per GPU process and per GPU of the node. NCCL enables NVLS
# by default (NCCL_NVLS_ENABLE, NCCL docs "Environment variables") where the GPUs support
# multicast (Hopper and newer on NVSwitch, CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED) and the
# communicator has more than 2 GPUs of the node (NVIDIA/nccl src/transport/nvls.cc
# `ncclNvlsInit`: `gpuCount <= 2` returns; vllm-project/vllm issue #9699 found it enabled only
# for more than 2 GPUs on H100 and above; NCCL 2.17-2.18 also enabled it for 2, not counted
# here). Every GPU allocates `nvlsTotalSize` of its own memory
# (nvls.cc `nvlsAllocateMem`/`nvlsGroupBindMem`: cuMemCreate on `comm->cudaDev`, bound to the
# multicast group), with nvlsTotalSize = nvlsPerRankSize * nHeads and nHeads = the node's GPUs.
# NCCL logged nvlsPerRankSize 301989888 (288 MiB: 24 channels x 2 x (4 MiB buffer + 2 MiB)) and
# nvlsTotalSize 2415919104 (2.25 GiB) on 8 H200s (vllm issue #9699; disabling NVLS there gave
# the KV cache more GPU blocks). Older NCCL (2.18: 16 channels) allocated 192 MiB per GPU of the
# node and newer NCCL (1 MiB buffers) less: the logged 288 MiB errs high, as an uncertain term
# should (issue #16). Memory nvidia-smi shows, outside torch's counters.
NCCL_NVLS_BYTES_PER_GPU = 288 * 2**20


def nvls_bytes(gpu: GPU, world: int) -> int:
    """NCCL's NVLS buffers of one GPU process (`NCCL_NVLS_BYTES_PER_GPU` x the node's GPUs):
    only on multicast-capable GPUs (compute capability >= 9.0) joined by NVLink (the catalog's
    NVSwitch parts: `interconnect_kind` "nvlink") and with more than 2 GPUs in the node. The
    node's GPUs are min(world, the GPU's `typical_gpus_per_node`): a multi-node job is taken
    to fill its nodes, which errs high when it does not."""
    if gpu.name == "cpu" or gpu.interconnect_kind != "nvlink":
        return 0
    try:
        major = int(str(gpu.compute_capability).split(".")[0])
    except ValueError:
        return 0
    local = min(world, max(gpu.typical_gpus_per_node, 1))
    if major < 9 or local <= 2:
        return 0
    return NCCL_NVLS_BYTES_PER_GPU * local


def device_overheads(gpu: GPU, world: int, settings: Settings = DEFAULT_SETTINGS) -> dict[str, int]:
    """Memory nvidia-smi shows that no tensor holds. Heuristics, stated:
    - CUDA context with lazy module loading (CUDA >= 11.7): ~300-500 MiB; 500 MiB on sm80+,
      400 MiB before (PyTorch docs, "CUDA semantics: memory management" and measured
      torch.cuda.mem_get_info deltas reported in PyTorch issue 20532);
    - cuBLAS beside the allocator: its handle and kernel images, 69,206,016 bytes measured on
      Hopper, 9 MiB assumed before (calibration.default_for; the cuBLAS workspaces are allocated
      tensors, counted in the allocated peak: calibration.allocator_workspaces);
    - NCCL (world > 1): `NCCL_CUMEM_BYTES` per process plus the NVLS buffers on NVSwitch
      systems (`nvls_bytes`), or `Settings.nccl_bytes`, or a measured calibration's per-peer
      figure. The `cpu` device runs gloo: no NCCL, no CUDA context.
    """
    cal = calibration.for_gpu(gpu.name, gpu.compute_capability)  # defaults: the values above
    if gpu.name == "cpu":
        nccl = 0
    elif world == 1:
        # measured on the GPU where a calibration has it (benchmarks/gpu_evidence.py: 1.0 GiB on
        # an H100, the same in 9 of 10 probes); else none
        nccl = cal.single_rank_extra_bytes or 0
    elif settings.nccl_bytes is not None:
        nccl = settings.nccl_bytes
    elif cal.measured and cal.nccl_bytes_per_peer is not None and cal.nccl_max_bytes is not None:
        nccl = min(cal.nccl_max_bytes, cal.nccl_bytes_per_peer * (world - 1))
    else:
        nccl = NCCL_CUMEM_BYTES + nvls_bytes(gpu, world)
    return {
        "cuda_context": cal.cuda_context_bytes,
        "cublas": cal.cublas_workspace_bytes,
        "nccl": nccl,
    }


def fragmentation(transient: int, settings: Settings, is_cpu: bool) -> int:
    """Reserved-but-unallocated bytes of the CUDA caching allocator at the peak.

    Blocks freed by one step's activations are cached for reuse; with variable-length batches the
    next step asks for other sizes and the cache splits into pieces (PyTorch docs, "Optimizing
    memory usage with PYTORCH_CUDA_ALLOC_CONF"). Modelled as a share of the shape-varying
    (activation/logit) bytes: 30% with variable lengths, 8% with fixed padded shapes, 3% with
    expandable_segments (segments grow in place, PyTorch 2.1+). Calibrate with probes.
    """
    if is_cpu:
        return 0
    if settings.expandable_segments:
        share = 0.03
    elif settings.variable_length:
        share = 0.30
    else:
        share = 0.08
    return int(share * transient)


def cached_logits_block(block: int, settings: Settings, is_cpu: bool) -> int:
    """Reserved memory the caching allocator cannot reuse for the next step's logits: one fp32
    logits block (`held_logits.fp32_logits_block`, 4 t V, or one chunk's 4 c V).

    The fp32 [t, V] blocks (log_softmax's output and its gradients) are a step's largest
    transient allocations. Freed after the loss backward they stay cached; the next forward's
    long-lived allocations (checkpointed layer inputs, live until the backward) are carved out of
    them, because the caching allocator splits cached large-pool blocks to serve smaller requests
    (PyTorch docs "CUDA semantics": max_split_size_mb "prevents the native allocator from
    splitting blocks larger than this size ... can reduce fragmentation";
    c10/cuda/CUDACachingAllocator.cpp `get_free_block` / `alloc_found_block`), so the next loss
    needs a fresh segment: one such block stays reserved beyond the allocated peak. Not on the
    `cpu` device (no caching allocator), not with expandable_segments (segments grow in place).
    """
    if is_cpu or settings.expandable_segments:
        return 0
    return block


@dataclass
class HostMemory:
    """Host RAM per node: the components at the peak and the total of each phase, bytes."""

    breakdown: dict[str, int]
    phases: dict[str, int]

    @property
    def peak(self) -> int:
        return max(self.phases.values())


def host_memory(
    arch: ModelArch,
    cand: Candidate,
    gpu: GPU,
    states: ModelStates,
    ranks_per_node: int,
    world: int,
    settings: Settings,
    activations_offloaded: int = 0,
) -> HostMemory:
    """Host RAM per node. Per rank: the process itself (CUDA/NCCL/Python, ~3 GiB on GPU nodes,
    0.6 GiB for a CPU rank: measured RSS of `import deepspeed, transformers`), the offloaded
    states, pinned buffers (power-of-two rounded), and the transient phases:
    - load: from_pretrained reads safetensors through mmap (page cache shared by the node's ranks)
    - resume, `trainer_loader` "deepspeed": every rank torch.load()s its optimizer shard (12 T / N
      fp32: master, m, v) and for ZeRO-0/1/2 the whole 16-bit module state
      (mp_rank_00_model_states.pt) at the same time (DeepSpeed's TorchCheckpointEngine.load);
      "memfit": the files are mapped and copied a chunk at a time, each chunk's pages released once
      copied (memfit.train.stream_load), so a rank maps at most CHECKPOINT_CHUNK_BYTES beyond
      training's memory (the page cache the files pass through is the kernel's to reclaim).
    - `activations_offloaded`: a rank's checkpointed layer inputs in pinned host buffers
      (offload_activations.offload_checkpoints), held through training."""
    ranks = ranks_per_node
    d = dtype_bytes(cand.precision)
    total = param_layout(arch).total
    trainable = trainable_params(arch, cand, settings)
    process = int((0.6 if gpu.name == "cpu" else 3.0) * GIB)
    offloaded = states.host_optimizer + states.host_params
    steady = ranks * (process + offloaded + states.host_pinned + activations_offloaded)
    optimizer_shard = 12 * trainable // (world if cand.zero >= 1 else 1)
    module_file = d * total if cand.zero < 3 else d * total // world
    files = optimizer_shard + module_file
    checkpoint = ranks * (files if settings.trainer_loader == "deepspeed" else min(files, CHECKPOINT_CHUNK_BYTES))
    init_pin = ranks * states.host_pin_source if cand.pin_memory else 0
    phases = {
        "steady": steady,
        "load": steady + d * total,
        "resume": steady + checkpoint,
        "init": steady + init_pin,
    }
    breakdown = {
        "process": ranks * process,
        "offloaded_optimizer": ranks * states.host_optimizer,
        "offloaded_params": ranks * states.host_params,
        "pinned_rounding": ranks * states.host_pinned,
        "checkpoint_resume": checkpoint,
        "offloaded_activations": ranks * activations_offloaded,
    }
    return HostMemory(
        breakdown={k: int(v) for k, v in breakdown.items()},
        phases={k: int(v) for k, v in phases.items()},
    )
