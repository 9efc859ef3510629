"""Model states per rank: what DeepSpeed ZeRO stage 0-3 keeps of weights, gradients and optimizer states on the device and
on the host.

The ZeRO paper (Rajbhandari et al. 2020, sec. 3, "2Ψ + 2Ψ + KΨ with K = 12") as DeepSpeed
implements it in `deepspeed/runtime/zero/stage_1_and_2.py` and `stage3.py`, over the parameter
layout of memfit.estimate.models.params; with DeepSpeed's
own assumptions these equal `estimate_zero2_model_states_mem_needs` and
`estimate_zero3_model_states_mem_needs` exactly (tests/test_estimate.py checks it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from memfit.estimate.memory.method_terms import reference_model
from memfit.estimate.memory.zero3 import zero3_gathered_bytes, zero3_subgroups
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.models.params import fused_expert_weights, param_layout, trainable_params
from memfit.estimate.settings import Settings, dtype_bytes
from memfit.space import Candidate

# bitsandbytes NF4 (Dettmers et al. 2023, QLoRA, sec. 3 "Double Quantization"): 4 bits per weight,
# one fp32 absmax per block of 64; double quantization stores the absmax in 8 bits with one fp32
# constant per 256 blocks: 4 + 8/64 + 32/(64*256) = 4.127 bits per parameter (bitsandbytes 0.50.2
# functional.py `quantize_4bit`: two codes per byte in `packed`, `_absmax` per block of
# `blocksize` = 64, `quantize_blockwise(_absmax - offset, blocksize=256)` for the nested 8-bit
# absmax and its fp32 absmax per 256 blocks). Fused experts (memfit.train.qlora_experts) are
# packed per expert the same way, plus one fp32 offset per expert matrix (negligible).
NF4_BYTES_PER_PARAM = (4 + 8 / 64 + 32 / (64 * 256)) / 8

# ---------------------------------------------------------------------------------------------
# Model states per rank (ZeRO)


# DeepSpeed 0.19.8 runtime/engine.py `allreduce_gradients(bucket_size=MEMORY_OPT_ALLREDUCE_SIZE)`,
# line 151: elements per flattened all-reduce bucket at ZeRO-0
MEMORY_OPT_ALLREDUCE_SIZE = 500_000_000


@dataclass
class ModelStates:
    """Bytes of the model states of one rank (device) and of its offloaded share (host)."""

    params: int = 0  # device: weights (16-bit or fp32; QLoRA 4-bit) incl. the frozen reference
    grads: int = 0  # device: gradient buffers that live through the step
    grads_dynamic: int = 0  # device: param.grad tensors created by backward, freed by zero_grad
    step_grads: int = 0  # device: gradient copies the optimizer wrapper makes inside the step, at their peak
    # device: gradients alive while the optimizer's update runs (None: grads_dynamic); the update's
    # own temporaries come on top of these, not of `step_grads`
    update_grads: int | None = None
    optimizer: int = 0  # device: fp32 master + Adam m and v (ZeRO's "K = 12")
    gathered: int = 0  # device: ZeRO-3 gathered full layer (weights + its grad) in flight
    buckets: int = 0  # device: ZeRO reduce/all-gather buckets, prefetch
    ref_gathered: int = 0  # device: the ZeRO-3 DPO reference's gathered parameters in its forward
    host_optimizer: int = 0  # host per rank: offloaded master/m/v/fp32 grads
    host_params: int = 0  # host per rank: offloaded 16-bit params
    host_pinned: int = 0  # host per rank: bytes pinned buffers take beyond their size (rounding)
    host_pin_source: int = 0  # host per rank: largest unpinned source copied into pinned memory
    optimizer_resident_fraction: float = 1.0  # share of optimizer states on the device
    offload_fraction: float = 0.0  # share actually offloaded (ZeRO-3 ratio, sub-group granularity)
    notes: list[str] = field(default_factory=list)


def pinned_rounding(n: int) -> int:
    """Bytes a pinned buffer of n bytes takes beyond n.

    PyTorch's CachingHostAllocator rounds pinned allocations up to the next power of two
    (aten/src/ATen/core/CachingHostAllocator.h: "Round up the allocation to the nearest power of
    two"), so a pinned 36 GB buffer takes 64 GB of page-locked RAM."""
    return _next_pow2(n) - n


def _next_pow2(n: int) -> int:
    return 1 << (int(n) - 1).bit_length() if n > 0 else 0


def reduce_bucket_elements(arch: ModelArch, settings: Settings) -> int:
    """reduce_bucket_size: h*h when scaled (dsconfig.bucket_sizes), else DeepSpeed's 5e8."""
    if settings.reduce_bucket_size is not None:
        return settings.reduce_bucket_size
    return arch.hidden_size**2 if settings.scaled_buckets else 500_000_000


@dataclass(frozen=True)
class _Sizes:
    """The quantities every stage's formula uses (bytes unless the name says otherwise)."""

    dtype: int  # d: bytes of the training dtype
    trainable: int  # T: trainable parameters
    world: int  # N: data-parallel ranks
    resident: int  # weights + adapters + DPO reference copy, as they sit in memory
    full: bool  # full fine-tuning (not LoRA/QLoRA)


def _resident_weight_bytes(arch: ModelArch, cand: Candidate, trainable: int, method: str, upcast: bool = False) -> int:
    """Weights, LoRA adapters and the DPO reference copy, unpartitioned."""
    layout = param_layout(arch)
    d = dtype_bytes(cand.precision)
    total = layout.total
    # QLoRA: the decoder-layer linears are NF4, embeddings/norms/lm_head stay 16-bit; LoRA adapters
    # are in the training dtype.
    if cand.finetune == "qlora":
        # MoE: bitsandbytes quantizes nn.Linear only; memfit stores the routed experts' fused 3D
        # weights in the same 4-bit format (memfit.train.qlora_experts: per expert, the packing
        # below); the router stays unquantized (kept as the other unquantized params, below)
        linear = sum(i * o for layer in range(arch.num_layers) for _, i, o in layout.layer_linear_shapes(arch, layer))
        linear += fused_expert_weights(arch)
        # peft's prepare_model_for_kbit_training upcasts the non-quantized params to fp32, and
        # HF Trainer keeps them there (`Settings.qlora_fp32_upcast`); DeepSpeed casts every
        # floating-point param back to the training dtype when it wraps the model (memfit's
        # trainer: runtime/engine.py `_configure_distributed_model` -> `_cast_module_mixed_precision`)
        kept = 4 if upcast else d
        weight_bytes = int(linear * NF4_BYTES_PER_PARAM) + (total - linear) * kept
    else:
        weight_bytes = total * d
    adapter_bytes = 0 if cand.finetune == "full" else trainable * d
    # DPO's and KTO's reference model (frozen, no grads or optimizer): a separate copy for ref=model (DeepSpeed
    # wraps it in an inference engine with the same ZeRO stage), the same weights with adapters
    # disabled for ref=adapter, nothing for precomputed log-probs.
    reference_bytes = weight_bytes if reference_model(cand, method) else 0
    # buffers, generic cards (the inventory has them): GPT-Neo's and GPT-1's causal-mask buffers
    # (max_positions^2 bools per layer) outweigh a small model's weights; rotary tables
    buffers = arch.inventory().buffers if arch.generic else 0
    return weight_bytes + adapter_bytes + reference_bytes + buffers * (2 if reference_bytes else 1)


def _stage0(cand: Candidate, sizes: _Sizes, engine: str = "deepspeed") -> ModelStates:
    """16-bit params, param.grad from backward, fp32 master + Adam m, v; fp32 training keeps no
    separate master (the params are the master: engine.py `_do_optimizer_sanity_check` wraps
    nothing when the model and gradient-accumulation dtypes are both fp32).

    16-bit at stage 0 (memfit sets no `data_types.grad_accum_dtype`, so it is the model's dtype):
    DeepSpeed 0.19.8 wraps the optimizer in FP16_Optimizer (engine.py `_do_optimizer_sanity_check`
    returns DDP_BFLOAT16 for bf16, FP16 for fp16; FusedAdam, also the CPU accelerator's, takes
    the fused wrapper), which keeps no gradient accumulator: its `step`
    (runtime/fp16/fused_optimizer.py) builds `_flatten_dense_tensors([p.grad.to(fp32) ...])`, so
    the per-parameter fp32 copies (4T) and their flat concatenation (4T) exist together beside
    the 16-bit gradients: 24 bytes per trainable parameter at the step. Measured: 24.0 on the
    CPU (bf16, 1 rank, demo model) and 24.04 on an H100 (Llama-3.1-8B with 4 layers, 43.05 GiB,
    benchmarks/results/gpu_evidence_h100-80gb.json), where the BF16_Optimizer model this
    replaces (a persistent fp32 accumulator, 20 bytes) said 36.8 GiB."""
    T, d = sizes.trainable, sizes.dtype
    fp32 = cand.precision == "fp32"
    if engine == "torch":
        # `Settings.zero0_engine`: a torch optimizer on the parameters' own gradients, and in 16-bit
        # an fp32 gradient beside the master (mixed-precision AMP-style trainers). This is the
        # formula memfit used for every stage-0 run before the DeepSpeed runs below were
        # measured; the public table's stage-0 rows (HF Trainer, torchtune, LLaMA-Factory) are
        # within its bounds with it and no measurement of those trainers' step is at hand.
        return ModelStates(
            params=sizes.resident, grads_dynamic=d * T, grads=0 if fp32 else 4 * T, optimizer=(8 if fp32 else 12) * T
        )
    # at the accumulation boundary the engine all-reduces the gradients in buckets of
    # MEMORY_OPT_ALLREDUCE_SIZE elements, each flattened into a new tensor (engine.py
    # `allreduce_gradients` -> `buffered_allreduce_fallback` -> `allreduce_bucket`:
    # `tensor = self.flatten(bucket)`), on one rank too: measured +4 bytes per parameter at an fp32
    # step on the CPU (20.0 per parameter, 1 rank, demo model)
    allreduce = d * min(T, MEMORY_OPT_ALLREDUCE_SIZE)
    return ModelStates(
        params=sizes.resident,
        grads_dynamic=d * T,
        optimizer=(8 if fp32 else 12) * T,
        step_grads=max(allreduce, 0 if fp32 else 8 * T),
        # the 16-bit grads are dropped (`p.grad = None`) before the update, which runs on the flat copy
        update_grads=None if fp32 else 4 * T,
    )


def _stage1_or_2(cand: Candidate, sizes: _Sizes) -> ModelStates:
    """Only what the optimizer owns is partitioned: LoRA/QLoRA's frozen base weights stay
    replicated. ZeRO-1/2 clone the fp32 partition (stage_1_and_2.py single_partition_of_fp32_groups)."""
    T, d, N = sizes.trainable, sizes.dtype, sizes.world
    states = ModelStates(params=sizes.resident, optimizer=12 * T // N)
    if cand.zero == 1:
        states.grads_dynamic = d * T  # full 16-bit grads until the reduce at the step boundary
    else:
        states.grads = d * T // N  # grads_in_partition, the training dtype
    # the step (stage_1_and_2.py `step`, no offload): the partition's averaged gradients are
    # flattened into a new tensor and converted to the fp32 master's dtype
    # (`flatten_dense_tensors_aligned(averaged_gradients).to(fp32)`: one tensor when training in
    # fp32), the update runs on that fp32 gradient. The fp32 gradient is not kept between steps:
    # measured 22.0 (bf16) and 24.0 (fp32) bytes per parameter at ZeRO-1/2 on the CPU (1 rank,
    # demo model) and 22.03 at bf16 ZeRO-2 on an H100 (benchmarks/results/gpu_evidence_h100-80gb.json),
    # where a persistent fp32 gradient said 20 and 24 with the backward's peak 4 bytes too high
    states.step_grads = (4 + (d if d != 4 else 0)) * T // N
    states.update_grads = 4 * T // N
    if cand.offload_optimizer == "cpu":
        # stage_1_and_2.py with cpu_offload: fp32 master, m, v and the fp32 grad partition
        # live on the host; the device keeps the 16-bit params and the buckets.
        states.host_optimizer = 16 * T // N
        states.grads, states.optimizer = 0, 0
        states.step_grads, states.update_grads = 0, None
        if cand.pin_memory:
            # the fp32 master partition (single_partition_of_fp32_groups) and the
            # averaged-gradient partition are pinned
            states.host_pinned = 2 * pinned_rounding(4 * T // N)
            states.host_pin_source = 4 * T // N
    return states


def _stage3_offload_optimizer(
    cand: Candidate,
    sizes: _Sizes,
    groups: tuple[int, ...],
    sub_group_size: int,
    states: ModelStates,
) -> None:
    """stage3.py `_create_fp32_partitions`: sub-group i goes to the host when
    i >= int((1 - ratio) * n_subgroups); the rest stays on the device."""
    T, N = sizes.trainable, sizes.world
    n = len(groups)
    first_offloaded = int((1 - cand.offload_ratio) * n)
    on_device = sum(g for i, g in enumerate(groups) if i < first_offloaded)
    on_host = sum(groups) - on_device
    fraction = on_host / max(sum(groups), 1)
    states.offload_fraction = fraction
    states.optimizer_resident_fraction = 1 - fraction
    if cand.offload_ratio < 1.0 and abs(fraction - cand.offload_ratio) > 0.02:
        states.notes.append(
            f"offload_ratio {cand.offload_ratio:g} offloads {fraction:.0%} of the optimizer states: "
            f"{n} sub-group(s) of sub_group_size {sub_group_size:.3g} per rank "
            f"(stage3.py _create_fp32_partitions rounds the ratio to whole sub-groups)"
        )
    # device keeps master/m/v (12) and the fp32 grad (4) of the device sub-groups
    states.optimizer = 12 * on_device
    states.grads = 4 * on_device
    states.host_optimizer = 12 * on_host + 4 * T // N  # + grad_partitions_flat_buffer on the host
    if cand.pin_memory:
        # the host sub-groups' fp32 master buffers and grad_partitions_flat_buffer
        host_groups = [g for i, g in enumerate(groups) if i >= first_offloaded]
        states.host_pinned = sum(pinned_rounding(4 * g) for g in host_groups)
        states.host_pinned += pinned_rounding(4 * T // N)
        states.host_pin_source = 4 * max(groups)


def _stage3(arch: ModelArch, cand: Candidate, sizes: _Sizes, settings: Settings) -> ModelStates:
    """Everything partitioned, the DPO reference too, plus the gathered parameters
    (`zero3_gathered_bytes`: the modules in use, those kept for reuse, the prefetched) and the
    16-bit gradient of the largest module before reduce-scatter (DeepSpeed's
    `largest_layer_memory = 4 * largest_layer_params`)."""
    T, d, N = sizes.trainable, sizes.dtype, sizes.world
    largest = param_layout(arch).largest_module
    groups = zero3_subgroups(arch, N, settings.sub_group_size) if sizes.full else (T // N,)
    # FSDP (`Settings.zero3_impl`, other stacks' runs): an fp32 gradient shard, as memfit counted it
    # before DeepSpeed's step was measured; no DeepSpeed sub-group copies
    deepspeed = settings.zero3_impl == "deepspeed"
    states = ModelStates(
        params=sizes.resident // N,
        # one rank gathers nothing: each partition is the whole parameter, and DeepSpeed "gathers"
        # it as a view of that partition (partition_parameters.py `all_gather_coalesced` ->
        # `_no_gather_coalesced` when `_partition_world_size(param) == 1`, `NoGatherHandle`);
        # measured on the CPU (fp32, 1 rank, demo model): the peak is the optimizer step's 24.2
        # bytes per parameter, not the backward with every layer gathered that 4 more would make
        gathered=(zero3_gathered_bytes(arch, cand, settings) if N > 1 or not deepspeed else 0)
        + (d * largest if sizes.full else 0),
        # grad_partitions_flat_buffer in the gradient-accumulation dtype, which is the model's
        # dtype unless `data_types.grad_accum_dtype` says otherwise (stage3.py; engine.py
        # `get_data_types`): 16-bit for bf16/fp16 training
        grads=(d if deepspeed else 4) * T // N,
        optimizer=12 * T // N,
        # the step, one sub-group at a time (stage3.py `_prepare_fp32_grad_for_sub_group`):
        # `flatten(averaged_gradients).to(fp32)`, a flat copy in the accumulation dtype and its fp32
        # conversion together (one tensor when that dtype is fp32). Measured on an H100 (bf16,
        # Llama-3.1-8B with 4 layers, one rank): 34.36 GiB, this model 34.3 GiB; the fp32 buffer
        # it replaces said 39.7 GiB (benchmarks/results/gpu_evidence_h100-80gb.json).
        step_grads=(4 + (d if d != 4 else 0)) * max(groups) if deepspeed else 0,
        # the fp32 gradient of the sub-group being updated
        update_grads=4 * max(groups) if deepspeed else None,
    )
    if cand.offload_optimizer == "cpu":
        # the host's sub-groups step there; the device ones are counted in `grads`
        states.step_grads, states.update_grads = 0, None
        _stage3_offload_optimizer(cand, sizes, groups, settings.sub_group_size, states)
    if cand.offload_param == "cpu":
        # partitioned 16-bit params live on the host, fetched per layer
        states.host_params, states.params = states.params, 0
        if cand.pin_memory:
            states.host_pinned += pinned_rounding(states.host_params)
    return states


def model_states(
    arch: ModelArch,
    cand: Candidate,
    world: int,
    settings: Settings,
    method: str = "sft",
) -> ModelStates:
    """Per-rank model states under DeepSpeed ZeRO stage 0-3 with optional offload.

    Ψ = all params, T = trainable params, N = data-parallel world size, d = bytes of the
    training dtype. ZeRO paper sec. 5 (Pos / Pos+g / Pos+g+p) as DeepSpeed implements it:
      stage 0: 16-bit params dΨ, grads dT, fp32 master+m+v 12T, and inside the step 8T of fp32
               gradient copies (FP16_Optimizer, `_stage0`)
      stage 1: dΨ + d T grads + 12 T / N, inside the step (d + 4) T / N (`_stage1_or_2`)
      stage 2: dΨ + d T / N + 12 T / N, inside the step (d + 4) T / N (DeepSpeed's own
               estimate_zero2_model_states_mem_needs says 2Ψ + 18Ψ/N for bf16 full: its 4Ψ/N
               fp32 gradient exists only inside the step)
      stage 3: (dΨ + (d + 12) T) / N + 2 d * largest module (gathered weight and its grad;
               DeepSpeed's `largest_layer_memory = 4 * largest_layer_params`), and inside the
               step (d + 4) x the largest optimizer sub-group (`_stage3`)
    fp32 training keeps no separate master copy at stage 0 (the params are the master), but
    ZeRO-1/2 clone the fp32 partition (stage_1_and_2.py single_partition_of_fp32_groups).
    """
    trainable = trainable_params(arch, cand, settings)
    sizes = _Sizes(
        dtype=dtype_bytes(cand.precision),
        trainable=trainable,
        world=world,
        resident=_resident_weight_bytes(arch, cand, trainable, method, settings.qlora_fp32_upcast),
        full=cand.finetune == "full",
    )
    if cand.zero == 0:
        states = _stage0(cand, sizes, settings.zero0_engine)
    elif cand.zero in (1, 2):
        states = _stage1_or_2(cand, sizes)
    else:
        states = _stage3(arch, cand, sizes, settings)
        if reference_model(cand, method) and world > 1 and settings.zero3_impl == "deepspeed":
            ref = dataclasses.replace(cand, grad_ckpt=False)  # memfit.train.reference: no checkpointing
            states.ref_gathered = zero3_gathered_bytes(arch, ref, settings, forward_only=True)
    # Reduce buckets (stage_1_and_2.py setup_buckets / stage3.py IPG buffer): one buffer of
    # reduce_bucket_size elements, two with overlap_comm; ZeRO-1 stages fp32. DeepSpeed allocates
    # the whole bucket with contiguous_gradients (its default), however few parameters train:
    # DeepSpeed 0.19.8 stage3.py `bucket.buffer = torch.empty(self.reduce_bucket_size, ...)` after
    # the optimizer states, stage_1_and_2.py `setup_buckets` `torch.empty(int(self.reduce_bucket_size))`
    # (the same eager buffer in the 0.13/0.14 releases of early 2024), so LoRA pays it in full.
    if cand.zero >= 1:
        elements = reduce_bucket_elements(arch, settings)
        overlap = settings.overlap_comm if settings.overlap_comm is not None else cand.zero >= 2
        buffers = 2 if (overlap and cand.zero < 3) else 1
        states.buckets += elements * (4 if cand.zero == 1 else sizes.dtype) * buffers
    return states
