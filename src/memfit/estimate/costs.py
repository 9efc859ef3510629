"""What a configuration costs besides its tensors: memory nvidia-smi shows that no tensor holds
(CUDA context, cuBLAS, NCCL), the caching allocator's fragmentation, host RAM per node, and the
time of one optimizer step. The numbers are stated heuristics, each with its source."""

from __future__ import annotations

from dataclasses import dataclass

from memfit.estimate import calibration, roofline, runtime_costs, timing
from memfit.estimate.arch import ModelArch
from memfit.estimate.catalog import GPU
from memfit.estimate.method_terms import grad_seqs, lm_head, nograd_seqs
from memfit.estimate.offload_activations import checkpoint_input_bytes
from memfit.estimate.params import param_layout, trainable_params
from memfit.estimate.settings import DEFAULT_SETTINGS, Settings, dtype_bytes
from memfit.estimate.states import ModelStates
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


def step_flops(
    arch: ModelArch, cand: Candidate, method: str, recompute: bool = True, settings: Settings | None = None
) -> float:
    """FLOPs of one optimizer step on one rank: 6 per parameter per token (Kaplan et al. 2020,
    sec. 2.1) plus attention 12*L*s*h per token (causal: half), 8/6 with recomputation of the
    layers (Korthikanti et al. 2022, sec. 5; the head is not recomputed, and counts as a matmul
    when tied to the embedding); LoRA skips weight gradients (4 instead of 6); DPO's reference
    adds a forward (2). tests/test_inventory.py checks this against FlopCounterMode on the traced
    step of the same model. Mixture-of-experts: a token runs through its top-k routed
    experts only, so the parameters are the ACTIVE ones (`ModelArch.num_active_params()`; Fedus
    et al. 2022, Switch Transformer, sec. 2: FLOPs per token follow the active parameters);
    routing's own FLOPs (softmax, top-k) are negligible. `recompute=False` leaves out what
    checkpointing and the chunked loss compute again: the model FLOPs of MFU (Chowdhery et al.
    2022, appendix B), not the hardware FLOPs.

    Generic cards (no formulas: memfit.estimate.generic), given `settings`: counted on the
    traced step instead (`traced.traced_step_flops`), so linear attention, sliding windows,
    latent attention and MoE routing cost what the model's code computes."""
    if arch.generic and settings is not None:
        from memfit.estimate.traced import traced_step_flops

        flops = traced_step_flops(arch, cand, method, settings, recompute)
        if cand.loss_impl == "chunked" and recompute and lm_head(method):
            flops += cand.grad_accum * 2 * arch.hidden_size * arch.vocab_size * grad_seqs(cand, method) * cand.seq_len
        return flops
    layout = param_layout(arch)
    tokens = grad_seqs(cand, method) * cand.seq_len  # forward and backward
    # forward only: KTO's KL batch through the policy, a reference model's forwards (DPO, KTO)
    nograd_tokens = nograd_seqs(cand, method) * cand.seq_len
    # a token attends over the whole sequence; with Ulysses a rank holds seq_len / SP of them
    # (core.per_rank) and attends for heads / SP over all seq_len: per rank the same as its
    # tokens over seq_len x SP attended positions
    attended = cand.seq_len * cand.sequence_parallel
    attention = 2 * arch.num_layers * attended * arch.num_attention_heads * arch.head_dim
    # the embedding is a lookup, not a matmul; the head is one (h x V) even when it shares the
    # embedding's weight (tied: `layout.lm_head` is 0, the matrix counted once in `total`), and
    # checkpointing recomputes the layers, not the head; a reward model's head is its h x 1 score
    # (`layout.lm_head` = h: ModelArch.score_head)
    layers_forward = 2 * (layout.total - layout.inactive - layout.embed - layout.lm_head) + attention
    head_forward = 2 * (layout.lm_head or layout.embed)
    passes = 3.0 if cand.finetune == "full" else 2.0
    recomputed = 1.0 if (cand.grad_ckpt and recompute) else 0.0
    flops = (layers_forward * (passes + recomputed) + head_forward * passes) * tokens
    flops += (layers_forward + head_forward) * nograd_tokens
    if cand.loss_impl == "chunked" and recompute and lm_head(method):
        # the head's projection (2 h V per token) runs again in the backward: the recompute of
        # Cut Cross-Entropy (Wijmans et al. 2024) and TRL's chunked_nll
        flops += 2 * arch.hidden_size * arch.vocab_size * tokens
    if cand.tiled_mlp and recompute:
        # TiledMLP recomputes each tile's MLP forward in its backward (ulysses_sp.TiledMLP.backward)
        mlp = (3 if arch.gated_mlp else 2) * arch.hidden_size * arch.intermediate_size
        flops += 2 * arch.num_layers * mlp * tokens
    return cand.grad_accum * flops


def uses_roofline(gpu: GPU) -> bool:
    """Whether the compute term is the per-operation roofline (memfit.estimate.roofline): on a
    GPU, unless its calibration file holds a measured whole-step rate `tflops.step`, which
    takes precedence. A catalog card's operations are counted by formula, a generic card's
    from its traced step."""
    measured_step = calibration.for_gpu(gpu.name, gpu.compute_capability).tflops.get("step")
    return gpu.name != "cpu" and not measured_step


def cpu_adam(gpu: GPU, settings: Settings) -> tuple[float, str]:
    """Parameters per second one rank's DeepSpeedCPUAdam steps, and where the rate comes from: a
    rate given (`--cpu-adam-rate` / `--cpu-cores-per-rank`, the config's `estimate.cpu_adam_*`),
    else the one the calibrate rule measured on this GPU's machine (`timing.cpu_adam`: written
    when the search space offloads the optimizer), else the default (`runtime_costs.cpu_adam_rate`,
    benchmarks/bench_cpu_adam.py's figure per core x 4 cores)."""
    given = (settings.cpu_adam_params_per_s_per_core, settings.cpu_cores_per_rank) != (
        DEFAULT_SETTINGS.cpu_adam_params_per_s_per_core,
        DEFAULT_SETTINGS.cpu_cores_per_rank,
    )
    if not given and settings.step_time_calibration:
        cal = timing.load(settings.step_time_calibration)
        measured = timing.cpu_adam(cal, gpu.name)
        if measured is not None:
            return float(measured["params_per_s_per_rank"]), timing.cpu_adam_label(cal, measured)
    return runtime_costs.cpu_adam_rate(settings), runtime_costs.cpu_adam_label(settings)


def compute_source(arch: ModelArch, cand: Candidate, gpu: GPU, settings: Settings) -> str:
    """Where the compute term comes from, for `Estimate.time_source`."""
    adam = f"; {cpu_adam(gpu, settings)[1]}" if cand.offload_optimizer == "cpu" else ""
    if uses_roofline(gpu):
        runtime = f"; {runtime_costs.RUNTIME_LABEL}" if gpu.name != "cpu" else ""
        return f"modelled (each operation at its roofline; {roofline.rates(gpu, cand.precision).source}{runtime}{adam})"
    if calibration.for_gpu(gpu.name, gpu.compute_capability).tflops.get("step"):
        return f"measured whole-step TFLOP/s of this GPU (config/calibration{adam})"
    return f"assumed ({settings.mfu:.0%} MFU of the dense peak, Chowdhery et al. 2022{adam})"


def _flops_seconds(arch: ModelArch, cand: Candidate, gpu: GPU, method: str, settings: Settings) -> float:
    """The step's computation where the roofline does not price it (`uses_roofline`): the step's
    FLOPs (`step_flops`, recomputation included) at a measured whole-step rate or a fixed share
    of the peak (the cpu without a calibration)."""
    peak = gpu.tflops(cand.precision) * 1e12
    if peak <= 0:
        peak = gpu.tflops_fp32 * 1e12
    efficiency = settings.mfu * (0.7 if cand.attn == "eager" else 1.0)
    achieved = calibration.for_gpu(gpu.name, gpu.compute_capability).tflops.get("step")
    if achieved:  # measured model-FLOP rate of the whole step (benchmarks/gpu_evidence.py) replaces peak x mfu
        peak, efficiency = achieved * 1e12, (0.7 if cand.attn == "eager" else 1.0)
    return step_flops(arch, cand, method, settings=settings) / (peak * efficiency)


def _communication_seconds(
    cand: Candidate,
    gpu: GPU,
    num_gpus: int,
    num_nodes: int,
    total: int,
    trainable: int,
    settings: Settings,
) -> float:
    """ZeRO-3: all-gather of the parameters in forward and backward (and recompute),
    reduce-scatter of gradients (ZeRO paper sec. 7: 1.5x the all-reduce volume); ZeRO-0/1/2:
    the gradient all-reduce, plus the all-gather of updated params at stage 1/2."""
    world = num_gpus * num_nodes
    if world == 1:
        return 0.0
    d = dtype_bytes(cand.precision)
    intra = gpu.interconnect_gbs * 1e9
    bandwidth = min(intra, settings.internode_gbs * 1e9 * num_gpus) if num_nodes > 1 else intra
    seconds = 0.0
    if cand.zero == 3:
        passes = 3 if cand.grad_ckpt else 2
        seconds += cand.grad_accum * passes * d * total * (world - 1) / world / bandwidth
        seconds += cand.grad_accum * d * trainable * (world - 1) / world / bandwidth
    else:
        seconds += 2 * d * trainable * (world - 1) / world / bandwidth
        if cand.zero >= 1:
            seconds += d * trainable * (world - 1) / world / bandwidth  # all-gather of updated params
    return seconds


def ulysses_seconds(
    arch: ModelArch, cand: Candidate, gpu: GPU, method: str, num_gpus: int, settings: Settings
) -> float:
    """Ulysses sequence parallelism's all-to-alls (Jacobs et al. 2023, DeepSpeed-Ulysses, arXiv
    2309.14509, sec. 3.1: per layer an all-to-all of q, k, v before attention and of its output
    after, each moving (SP - 1) / SP of the tensor; the backward the same again, the
    recomputation with checkpointing a third time). `cand.seq_len` is one rank's share
    (core.per_rank); a group within a node (SP <= GPUs per node) uses the GPU interconnect, one
    across nodes the inter-node link."""
    sp = cand.sequence_parallel
    if sp == 1:
        return 0.0
    sequences = grad_seqs(cand, method)
    head = arch.head_dim
    per_layer = (
        dtype_bytes(cand.precision)
        * sequences
        * cand.seq_len
        * head
        * (2 * arch.num_attention_heads + 2 * arch.num_kv_heads)
    )
    passes = 3 if cand.grad_ckpt else 2
    bandwidth = (gpu.interconnect_gbs if sp <= num_gpus else settings.internode_gbs) * 1e9
    return cand.grad_accum * passes * arch.num_layers * per_layer * (sp - 1) / sp / bandwidth


def _offload_seconds(
    cand: Candidate,
    gpu: GPU,
    num_gpus: int,
    world: int,
    total: int,
    trainable: int,
    states: ModelStates,
    settings: Settings,
) -> float:
    """Gradients down and parameters up over the host link, DeepSpeedCPUAdam's step over the rank's
    partition at `cpu_adam`'s rate (each rank steps its own partition on its cores)."""
    d = dtype_bytes(cand.precision)
    link = gpu.host_link_gbs * 1e9
    seconds = 0.0
    if cand.offload_optimizer == "cpu":
        fraction = states.offload_fraction if cand.zero == 3 else 1.0
        seconds += fraction * (4 + d) * trainable / world / link  # fp32 grads down, 16-bit params up
        seconds += fraction * trainable / world / cpu_adam(gpu, settings)[0]
    if cand.offload_param == "cpu":
        passes = 3 if cand.grad_ckpt else 2
        seconds += cand.grad_accum * passes * d * total / world / link
    return seconds


def activation_offload_seconds(
    arch: ModelArch, cand: Candidate, gpu: GPU, method: str, compute_seconds: float
) -> float:
    """The checkpointed inputs' trips to the host and back (offload_activations.offload_checkpoints),
    beyond what the compute hides: DeepSpeed copies them on a side stream that overlaps the
    forward and backward (offload_activations.py `_start_offload`, `restore_input`), so only the
    part of the transfers longer than the step's compute adds time (ALST, arXiv 2506.13996, sec.
    3.4: the offload costs little because the copies overlap compute)."""
    if not (cand.activation_offload and cand.grad_ckpt) or gpu.name == "cpu":
        return 0.0
    moved = 2 * max(0, arch.num_layers - 1) * checkpoint_input_bytes(arch, cand, method)
    return max(0.0, cand.grad_accum * moved / (gpu.host_link_gbs * 1e9) - compute_seconds)


def step_time(
    arch: ModelArch,
    cand: Candidate,
    gpu: GPU,
    method: str,
    num_gpus: int,
    num_nodes: int,
    states: ModelStates,
    settings: Settings,
) -> dict[str, float]:
    """Seconds per optimizer step, good enough to rank candidates (calibrated by probes later):
    compute, communication, offload, the optimizer's pass over its states, fixed overhead."""
    return modelled_step(arch, cand, gpu, method, num_gpus, num_nodes, states, settings)[0]


def modelled_step(
    arch: ModelArch,
    cand: Candidate,
    gpu: GPU,
    method: str,
    num_gpus: int,
    num_nodes: int,
    states: ModelStates,
    settings: Settings,
) -> tuple[dict[str, float], dict[str, float]]:
    """`step_time`'s terms, and the compute term by operation class (gemm, attention, memory
    seconds) where the roofline priced it (`uses_roofline`; else empty)."""
    world = num_gpus * num_nodes
    total = param_layout(arch).total
    trainable = trainable_params(arch, cand, settings)
    # a step's fixed overhead (launches, Python, the engine's bookkeeping)
    overhead = 0.005 * arch.num_layers / 32 * cand.grad_accum + 0.01
    bandwidth = roofline.rates(gpu, cand.precision).memory
    optimizer = 0.0
    if cand.offload_optimizer != "cpu":
        optimizer = runtime_costs.optimizer_seconds(arch, cand, gpu, trainable, world, settings, bandwidth)
    terms = roofline.compute_seconds(arch, cand, gpu, method, settings) if uses_roofline(gpu) else {}
    compute = sum(terms.values()) if terms else _flops_seconds(arch, cand, gpu, method, settings)
    zero = runtime_costs.zero_runtime_seconds(arch, cand, gpu, method, trainable, total, bandwidth, settings)
    breakdown = {
        "compute": compute,
        "communication": _communication_seconds(cand, gpu, num_gpus, num_nodes, total, trainable, settings)
        + ulysses_seconds(arch, cand, gpu, method, num_gpus, settings),
        "offload": _offload_seconds(cand, gpu, num_gpus, world, total, trainable, states, settings)
        + activation_offload_seconds(arch, cand, gpu, method, compute),
        "optimizer": optimizer,
        "zero_reduce": zero["reduce"],
        "zero3_gather": zero["gather"],
        "overhead": overhead,
    }
    return breakdown, terms
