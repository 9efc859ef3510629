"""How much memory and time a fine-tuning configuration needs, predicted without a GPU.

    memfit estimate --model qwen2-7b --gpu rtx4090 --num-gpus 4 --zero 3 --seq-len 128 --json
    memfit fit --maximize seq_len --model glm-4-9b --gpu a100-80gb --num-gpus 8 --method dpo

`estimate()` is pure arithmetic over the architecture card (`catalog.ModelArch`), the GPU
card (`catalog.GPU`) and one `space.Candidate`. Every term says where it comes from:

- model states (params, grads, optimizer): the ZeRO paper (Rajbhandari et al. 2020, sec. 3,
  "2Ψ + 2Ψ + KΨ with K = 12") as DeepSpeed implements it in
  `deepspeed/runtime/zero/stage_1_and_2.py` and `stage3.py`; with DeepSpeed's own
  assumptions they equal `estimate_zero2_model_states_mem_needs` and
  `estimate_zero3_model_states_mem_needs` exactly (tests/test_estimate.py checks it).
- activations: what autograd saves in transformers' decoder layer (modeling_llama.py,
  modeling_qwen2.py), tensor by tensor; the structure of Korthikanti et al. 2022 ("Reducing
  Activation Recomputation in Large Transformer Models", sec. 4.1: sbh(34 + 5as/h)), re-derived
  for RMSNorm + SwiGLU + GQA + rotary and for the attention kernels: eager attention keeps the
  s x s probabilities (fp32 softmax); SDPA and FlashAttention keep only the output and the
  log-sum-exp (Dao et al. 2022, FlashAttention, sec. 3.1). Checked against real training steps
  measured with `memory.AllocationTracker` (tests/test_estimate_groundtruth.py).
- the logits term: HF `ForCausalLMLoss` (loss_utils.py) upcasts logits to fp32 and
  log-softmax keeps an fp32 [tokens, vocab] output; its backward briefly holds two more.
- or, with `Settings(activations="traced")` / `--activations traced`, the activation and logit
  terms from a traced run of the model's own transformers code on fake CPU tensors (1 and 2
  layers, per sequence, cached per shape: memfit.trace, `traced_activations`); the Estimate's
  `activations_source` says which. On the CPU ground truth below the traced peaks are within
  3.0% (median 0.1%) where the formulas are within 4.5% (median 0.4%), on 32 cases.
- fragmentation, CUDA context and workspaces: stated heuristics (see `_device_overheads`).

The numbers are per rank (one GPU), in bytes. Host memory is per node.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from dataclasses import dataclass, field
from typing import Any

from memfit import calibration, catalog
from memfit.catalog import GPU, ModelArch
from memfit.space import Candidate

GIB = 2**30
MIB = 2**20

# ---------------------------------------------------------------------------------------------
# Knobs that are not search axes: DeepSpeed bucket sizes, LoRA targets, allocator settings.


@dataclass(frozen=True)
class Settings:
    """Everything besides the candidate that changes memory. Defaults follow what memfit's
    trainer writes (`dsconfig.build`): DeepSpeed defaults, with the bucket sizes scaled to the
    model (`dsconfig.bucket_sizes`, HF's resolution of "auto") when `scaled_buckets`."""

    scaled_buckets: bool = True  # bucket sizes = h*h (dsconfig.bucket_sizes); False: DS defaults
    reduce_bucket_size: int | None = None  # elements; None: from scaled_buckets
    allgather_bucket_size: int | None = None  # elements (ZeRO-1/2 parameter all-gather)
    stage3_prefetch_bucket_size: int | None = None  # elements gathered ahead of use (ZeRO-3)
    stage3_max_live_parameters: int = 1_000_000_000  # DS default (runtime/zero/config.py)
    sub_group_size: int = 1_000_000_000  # DS default; ZeRO-3 optimizer sub-group, elements
    overlap_comm: bool | None = None  # None: as dsconfig writes it (stage >= 2)
    lora_targets: tuple[str, ...] | None = None  # None: every linear of the decoder layer
    lora_alpha_dropout: bool = False  # lora_dropout > 0 saves a dropout mask+output per target
    expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    variable_length: bool = True  # batches of varying length (fragmentation), False: padded
    optimizer_impl: str | None = None  # "fused" (DS FusedAdam), "foreach" or "single" (torch)
    mfu: float = 0.40  # model FLOPs utilisation of the GPU's dense peak (Chowdhery et al. 2022)
    cpu_adam_params_per_s: float = 1.0e9  # DeepSpeedCPUAdam throughput per node (AVX512, ~32 cores)
    internode_gbs: float = 25.0  # per-GPU inter-node bandwidth, GB/s (200 Gb/s InfiniBand)
    activations: str = "analytic"  # "analytic" (formulas) or "traced" (memfit.trace, cached)
    trace_cache: str | None = None  # traced: cache directory (None: $MEMFIT_TRACE_CACHE or default)


DEFAULT_SETTINGS = Settings()


@dataclass
class Estimate:
    """The prediction for one configuration on one rank. Bytes unless the name says otherwise."""

    peak_allocated_bytes: int = 0  # torch.cuda.max_memory_allocated
    peak_reserved_bytes: int = (
        0  # torch.cuda.max_memory_reserved (allocator caching, fragmentation)
    )
    device_total_bytes: int = 0  # nvidia-smi: reserved + CUDA context + workspaces
    device_memory_bytes: int = 0  # the device's whole memory (or the budget)
    host_bytes: int = 0  # host RAM per node at its peak
    host_memory_bytes: int = 0  # the node's RAM
    fits: bool = False
    margin_bytes: int = 0  # device memory minus device_total (negative: short by that much)
    host_margin_bytes: int = 0
    step_time_s: float = 0.0  # one optimizer step (grad_accum micro steps)
    tokens_per_s: float = 0.0  # trained tokens per second over all ranks
    peak_phase: str = ""  # which phase of training holds the peak
    breakdown: dict[str, int] = field(default_factory=dict)  # components at the peak, sum = peak
    phases: dict[str, int] = field(default_factory=dict)  # allocated peak of each phase
    host_breakdown: dict[str, int] = field(default_factory=dict)  # per node at the host peak
    host_phases: dict[str, int] = field(default_factory=dict)
    time_breakdown: dict[str, float] = field(default_factory=dict)
    params_total: int = 0
    params_trainable: int = 0
    eager_attention_extra_bytes: int = 0  # eager only: device bytes over the same config with sdpa
    activations_source: str = "analytic"  # "analytic" or "traced" (activation/logit terms)
    calibration: str = calibration.UNCALIBRATED  # "measured <date> on <device>" or uncalibrated
    notes: list[str] = field(default_factory=list)  # what the user should know (said once each)
    invalid: bool = False
    reason: str = ""  # why the hardware cannot run it, when invalid

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class EstimateError(ValueError):
    """Bad input: unknown names, a config missing a field, an impossible combination."""


# ---------------------------------------------------------------------------------------------
# Parameters of the architecture, in HF module order.


@dataclass(frozen=True)
class ParamLayout:
    total: int  # every parameter, tied embeddings once
    embed: int  # V*h
    lm_head: int  # V*h, 0 when tied
    per_layer: int  # one decoder layer, norms and biases included
    layer_tensors: tuple[int, ...]  # numel of each parameter tensor of one decoder layer
    linear_shapes: tuple[tuple[str, int, int], ...]  # (name, in, out) per decoder layer
    largest_module: int  # DS `model_to_params`: largest params of a single module (recurse=False)


@functools.lru_cache(maxsize=256)
def param_layout(arch: ModelArch) -> ParamLayout:
    """Parameter tensors of the HF implementation. Matches `ModelArch.num_params()`."""
    h, hd = arch.hidden_size, arch.head_dim
    shapes = arch.linear_shapes()
    q_out, kv_out = arch.num_attention_heads * hd, arch.num_kv_heads * hd
    tensors: list[int] = []
    for name, (i, o) in shapes.items():
        tensors.append(i * o)
        if arch.attention_bias and name in ("q_proj", "k_proj", "v_proj"):
            tensors.append(o)
        if arch.attention_bias and name == "query_key_value":
            tensors.append(q_out + 2 * kv_out)
        if getattr(arch, "attention_out_bias", False) and name in ("o_proj", "dense"):
            tensors.append(h)
        if getattr(arch, "mlp_bias", False) and name in (
            "gate_proj",
            "up_proj",
            "down_proj",
            "gate_up_proj",
        ):
            tensors.append(o)
    tensors += [h] * getattr(arch, "norms_per_layer", 2)
    if arch.qk_norm:
        tensors += [hd, hd]
    per_layer = sum(tensors)
    embed = arch.vocab_size * h
    lm_head = 0 if arch.tie_word_embeddings else embed
    total = embed + arch.num_layers * per_layer + h + lm_head
    largest = max([embed, *tensors])
    return ParamLayout(
        total=total,
        embed=embed,
        lm_head=lm_head,
        per_layer=per_layer,
        layer_tensors=tuple(tensors),
        linear_shapes=tuple((n, i, o) for n, (i, o) in shapes.items()),
        largest_module=largest,
    )


def lora_targets(arch: ModelArch, settings: Settings) -> tuple[tuple[str, int, int], ...]:
    shapes = param_layout(arch).linear_shapes
    if settings.lora_targets is None:
        return shapes  # peft target_modules="all-linear" (lm_head excluded)
    unknown = sorted(set(settings.lora_targets) - {n for n, _, _ in shapes})
    if unknown:
        raise EstimateError(
            f"unknown LoRA target(s) {unknown} for {arch.name}; linear layers: {[n for n, _, _ in shapes]}"
        )
    return tuple(s for s in shapes if s[0] in settings.lora_targets)


def trainable_params(arch: ModelArch, cand: Candidate, settings: Settings) -> int:
    """Full: every parameter. LoRA/QLoRA: A (r x in) and B (out x r) per targeted linear
    (Hu et al. 2021, sec. 4; peft LoraLayer.update_layer)."""
    if cand.finetune == "full":
        return param_layout(arch).total
    r = cand.lora_rank
    return arch.num_layers * sum(r * (i + o) for _, i, o in lora_targets(arch, settings))


# bitsandbytes NF4 (Dettmers et al. 2023, QLoRA, sec. 3 "Double Quantization"): 4 bits per weight,
# one fp32 absmax per block of 64; double quantization stores the absmax in 8 bits with one fp32
# constant per 256 blocks: 4 + 8/64 + 32/(64*256) = 4.127 bits per parameter.
NF4_BYTES_PER_PARAM = (4 + 8 / 64 + 32 / (64 * 256)) / 8


def _dtype_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


# ---------------------------------------------------------------------------------------------
# Hardware validity


def hardware_problems(gpu: GPU, cand: Candidate) -> list[str]:
    """Combinations the hardware cannot run (not estimated: reported with the reason)."""
    out = []
    is_cpu = gpu.name == "cpu"
    if cand.precision == "bf16" and not gpu.bf16:
        out.append(
            f"{gpu.name} has no bf16 support (compute capability {gpu.compute_capability}); use fp16 or fp32"
        )
    if cand.attn == "flash" and (is_cpu or not gpu.flash_attn2):
        out.append(
            f"FlashAttention-2 does not run on {gpu.name}"
            + (
                ""
                if is_cpu
                else f" (needs sm80+, this is sm{gpu.compute_capability.replace('.', '')})"
            )
            + "; use sdpa or eager"
        )
    if cand.finetune == "qlora" and is_cpu:
        out.append("QLoRA's bitsandbytes 4-bit kernels need a CUDA GPU; use lora on cpu")
    if (cand.offload_optimizer != "none" or cand.offload_param != "none") and is_cpu:
        out.append(
            "offloading to the host from the host (gpu=cpu) has no meaning; use offload none"
        )
    return out


# ---------------------------------------------------------------------------------------------
# Model states per rank (ZeRO)


@dataclass
class _States:
    params: int = 0  # device: weights (16-bit or fp32; QLoRA 4-bit) incl. the frozen reference
    grads: int = 0  # device: gradient buffers that live through the step
    grads_dynamic: int = 0  # device: param.grad tensors created by backward, freed by zero_grad
    optimizer: int = 0  # device: fp32 master + Adam m and v (ZeRO's "K = 12")
    gathered: int = 0  # device: ZeRO-3 gathered full layer (weights + its grad) in flight
    buckets: int = 0  # device: ZeRO reduce/all-gather buckets, prefetch
    host_optimizer: int = 0  # host per rank: offloaded master/m/v/fp32 grads
    host_params: int = 0  # host per rank: offloaded 16-bit params
    host_pinned: int = 0  # host per rank: bytes pinned buffers take beyond their size (rounding)
    host_pin_source: int = 0  # host per rank: largest unpinned source copied into pinned memory
    optimizer_resident_fraction: float = 1.0  # share of optimizer states on the device
    offload_fraction: float = 0.0  # share actually offloaded (ZeRO-3 ratio, sub-group granularity)
    notes: list[str] = field(default_factory=list)


def _pow2(n: int) -> int:
    # PyTorch's CachingHostAllocator rounds pinned allocations up to the next power of two
    # (aten/src/ATen/core/CachingHostAllocator.h: "Round up the allocation to the nearest power of
    # two"), so a pinned 36 GB buffer takes 64 GB of page-locked RAM.
    return 1 << (int(n) - 1).bit_length() if n > 0 else 0


@functools.lru_cache(maxsize=1024)
def zero3_subgroups(arch: ModelArch, world: int, sub_group_size: int) -> tuple[int, ...]:
    """Numel of each ZeRO-3 optimizer sub-group on one rank.

    stage3.py `_create_fp16_sub_groups`: parameters (their partition_numel, ceil(numel/world))
    are appended in module order until the running sum reaches sub_group_size."""
    lay = param_layout(arch)
    order = [lay.embed]
    order += list(lay.layer_tensors) * arch.num_layers
    order += [arch.hidden_size] + ([lay.lm_head] if lay.lm_head else [])
    parts = [-(-n // world) for n in order]
    if sum(parts) <= sub_group_size:
        return (sum(parts),)
    groups, acc = [], 0
    for p in parts:
        acc += p
        if acc >= sub_group_size:
            groups.append(acc)
            acc = 0
    if acc:
        groups.append(acc)
    return tuple(groups)


def model_states(
    arch: ModelArch,
    cand: Candidate,
    world: int,
    ranks_per_node: int,
    settings: Settings,
    method: str = "sft",
) -> _States:
    """Per-rank model states under DeepSpeed ZeRO stage 0-3 with optional offload.

    Ψ = all params, T = trainable params, N = data-parallel world size, d = bytes of the
    training dtype. ZeRO paper sec. 5 (Pos / Pos+g / Pos+g+p) as DeepSpeed implements it:
      stage 0: 16-bit params dΨ, grads, fp32 master+m+v 12T (bf16: DeepSpeed's BF16_Optimizer also
               keeps an fp32 gradient accumulator, 4T: runtime/bf16_optimizer.py)
      stage 1: dΨ + d T grads + (4 + 12) T / N   (fp32 grad partition staged at reduce)
      stage 2: dΨ + (d + 4) T / N + 12 T / N     (= DeepSpeed's 2Ψ + 18Ψ/N for bf16 full)
      stage 3: (dΨ + (4 + 12) T) / N + 2 d * largest module (gathered weight and its grad;
               DeepSpeed's `largest_layer_memory = 4 * largest_layer_params`)
    fp32 training keeps no separate master copy at stage 0 (the params are the master), but
    ZeRO-1/2 clone the fp32 partition (stage_1_and_2.py single_partition_of_fp32_groups).
    """
    s = _States()
    lay = param_layout(arch)
    d = _dtype_bytes(cand.precision)
    P = lay.total
    T = trainable_params(arch, cand, settings)
    N = world
    stage = cand.zero
    full = cand.finetune == "full"

    # Weight bytes of the model as it sits in memory. QLoRA: the decoder-layer linears are NF4,
    # embeddings/norms/lm_head stay 16-bit; LoRA adapters are in the training dtype.
    if cand.finetune == "qlora":
        lin = arch.num_layers * sum(i * o for _, i, o in lay.linear_shapes)
        weight_bytes = int(lin * NF4_BYTES_PER_PARAM) + (P - lin) * d
        # peft.prepare_model_for_kbit_training upcasts the remaining (non-quantized) params to fp32
        weight_bytes += (P - lin) * (4 - d)
    else:
        weight_bytes = P * d
    adapter_bytes = 0 if full else T * d

    # DPO reference model (frozen, no grads or optimizer): a separate copy for ref=model, the same
    # weights with adapters disabled for ref=adapter, nothing for precomputed log-probs.
    ref_bytes = 0
    if method == "dpo" and cand.ref == "model":
        ref_bytes = (
            weight_bytes  # DeepSpeed wraps it in an inference engine with the same ZeRO stage
        )

    # LoRA/QLoRA under ZeRO-1/2: only what the optimizer owns is partitioned; the frozen base
    # weights stay replicated (weight_bytes above is not divided by the data-parallel size).

    master = 0 if (cand.precision == "fp32" and stage == 0) else 4
    opt_per_T = master + 8  # fp32 master (if any) + Adam exp_avg + exp_avg_sq
    accum32 = 4 if cand.precision != "fp32" else 0  # fp32 gradient accumulation buffer

    offload_opt = cand.offload_optimizer == "cpu"
    offload_par = cand.offload_param == "cpu"

    if stage == 0:
        s.params = weight_bytes + adapter_bytes + ref_bytes
        s.grads_dynamic = d * T
        s.grads = accum32 * T if cand.precision != "fp32" else 0
        s.optimizer = opt_per_T * T
    elif stage in (1, 2):
        s.params = weight_bytes + adapter_bytes + ref_bytes
        if stage == 1:
            s.grads_dynamic = d * T  # full 16-bit grads until the reduce at the step boundary
            s.grads = 4 * T // N  # fp32 partition of the averaged gradient
        else:
            s.grads = (d + 4) * T // N  # grads_in_partition (16-bit) + fp32 partition grad
            if cand.precision == "fp32":
                s.grads = 4 * T // N + 4 * T // N
        s.optimizer = 12 * T // N
        if offload_opt:
            # stage_1_and_2.py with cpu_offload: fp32 master, m, v and the fp32 grad partition
            # live on the host; the device keeps the 16-bit params and the buckets.
            s.host_optimizer = 16 * T // N
            s.grads, s.optimizer = 0, 0
            if cand.pin_memory:
                # single_partition_of_fp32_groups and the averaged-gradient buffer are pinned
                # fp32 master partition and the averaged-gradient partition are pinned
                s.host_pinned = 2 * (_pow2(4 * T // N) - 4 * T // N)
                s.host_pin_source = 4 * T // N
    else:  # stage 3: everything partitioned, the reference too
        s.params = (weight_bytes + adapter_bytes + ref_bytes) // N
        big = lay.largest_module
        # the gathered largest module in flight, its 16-bit gradient before reduce-scatter
        s.gathered = d * big + (d * big if full else 0)
        s.grads = 4 * T // N  # grad_partitions_flat_buffer (fp32) on the device
        s.optimizer = 12 * T // N
        groups = zero3_subgroups(arch, N, settings.sub_group_size) if full else (T // N,)
        if offload_opt:
            n = len(groups)
            # stage3.py `_create_fp32_partitions`: sub-group i goes to the host when
            # i >= int((1 - ratio) * n_subgroups); the rest stays on the device.
            on_device = sum(
                g for i, g in enumerate(groups) if i < int((1 - cand.offload_ratio) * n)
            )
            on_host = sum(groups) - on_device
            frac = on_host / max(sum(groups), 1)
            s.offload_fraction = frac
            s.optimizer_resident_fraction = 1 - frac
            if cand.offload_ratio < 1.0 and abs(frac - cand.offload_ratio) > 0.02:
                s.notes.append(
                    f"offload_ratio {cand.offload_ratio:g} offloads {frac:.0%} of the optimizer states: "
                    f"{n} sub-group(s) of sub_group_size {settings.sub_group_size:.3g} per rank "
                    f"(stage3.py _create_fp32_partitions rounds the ratio to whole sub-groups)"
                )
            # device keeps master/m/v (12) and the fp32 grad (4) of the device sub-groups
            s.optimizer = 12 * on_device
            s.grads = 4 * on_device
            s.host_optimizer = (
                12 * on_host + 4 * T // N
            )  # + grad_partitions_flat_buffer on the host
            if cand.pin_memory:
                # the host sub-groups' fp32 master buffers and grad_partitions_flat_buffer
                host_groups = [
                    g for i, g in enumerate(groups) if i >= int((1 - cand.offload_ratio) * n)
                ]
                s.host_pinned = sum(_pow2(4 * g) - 4 * g for g in host_groups)
                s.host_pinned += _pow2(4 * T // N) - 4 * T // N
                s.host_pin_source = 4 * max(groups)
        if offload_par:
            # partitioned 16-bit params live on the host, fetched per layer
            s.host_params = s.params
            s.params = 0
            if cand.pin_memory:
                s.host_pinned += _pow2(s.host_params) - s.host_params
        pb = _bucket(settings, arch, "prefetch")
        s.buckets += d * min(pb, settings.stage3_max_live_parameters)
    # Reduce buckets (stage_1_and_2.py setup_buckets / stage3.py IPG buffer): one buffer of
    # reduce_bucket_size elements, two with overlap_comm; ZeRO-1 stages fp32.
    if stage >= 1:
        rb = min(_bucket(settings, arch, "reduce"), max(T, 1))
        overlap = settings.overlap_comm if settings.overlap_comm is not None else stage >= 2
        nbuf = 2 if (overlap and stage < 3) else 1
        s.buckets += rb * (4 if stage == 1 else d) * nbuf
    return s


def _bucket(settings: Settings, arch: ModelArch, kind: str) -> int:
    h2 = arch.hidden_size**2
    if kind == "reduce":
        v = settings.reduce_bucket_size
        return v if v is not None else (h2 if settings.scaled_buckets else 500_000_000)
    if kind == "allgather":
        v = settings.allgather_bucket_size
        return v if v is not None else (h2 if settings.scaled_buckets else 500_000_000)
    v = settings.stage3_prefetch_bucket_size
    return v if v is not None else (int(0.9 * h2) if settings.scaled_buckets else 50_000_000)


# ---------------------------------------------------------------------------------------------
# Activations of one micro step (per rank)


@dataclass
class _Acts:
    saved: int = 0  # everything autograd keeps after the forward (incl. the logits terms)
    per_layer: int = (
        0  # one decoder layer's saved tensors (recomputed per layer with checkpointing)
    )
    logits_saved: int = 0  # logits + fp32 log-softmax kept for the backward
    logits_bwd_extra: int = 0  # the loss backward's two fp32 [tokens, vocab] gradients
    layer_bwd: int = 0  # transient gradients inside one layer's backward
    mlp_bwd: int = 0  # ... at the MLP's backward (runs first)
    attn_bwd: int = 0  # ... at the attention's backward (MLP tensors already freed)
    final: int = 0  # the final norm's saved tensors (freed before the layers' backward)
    kept_per_layer: int = 0  # what stays saved per layer until its backward
    recompute: int = 0  # checkpointing: one layer's recomputed tensors during its backward
    attention_scores: int = (
        0  # eager only: the s x s probabilities of all layers (for the breakdown)
    )
    ref_forward: int = 0  # DPO reference forward transient (no_grad)
    forward: int = 0  # the policy forward's peak (last layer's attention call)


def activations(arch: ModelArch, cand: Candidate, method: str, settings: Settings) -> _Acts:
    """Bytes autograd keeps for one micro step, tensor by tensor as transformers' Llama/Qwen2
    decoder layer saves them (modeling_llama.py LlamaRMSNorm, LlamaAttention, LlamaMLP).

    t = tokens in the forward (micro_batch * seq_len, doubled for DPO's concatenated
    chosen+rejected batch), d = compute dtype bytes.
    Per layer, full fine-tuning:
      RMSNorm x2: the fp32 input (upcast copy in 16-bit; the input itself in fp32) 4th,
                  the normalised x*rsqrt dth (saved by the weight multiply), the output dth
                  (saved by the next linear), rsqrt 4t
      attention:  rotated q dt*qd, rotated k and v dt*kvd each, output dt*qd;
                  sdpa/flash: log-sum-exp 4*b*heads*s (FlashAttention-2 softmax_lse);
                  eager: fp32 softmax 4*b*heads*s^2 (+ its 16-bit copy), repeat_kv'd k and v
      SwiGLU:     gate, silu(gate), up, silu(gate)*up: 4dti (non-gated: 2dti)
    LoRA: frozen weights keep nothing for their own gradient, so the normalised x of the norms
    and the inputs of frozen, non-adapted linears are not saved; each adapter keeps its
    r-wide hidden dtr.
    """
    a = _Acts()
    d = _dtype_bytes(cand.precision)
    b = cand.micro_batch * (2 if method == "dpo" else 1)
    sq = cand.seq_len
    t = b * sq
    h, i, V = arch.hidden_size, arch.intermediate_size, arch.vocab_size
    nh, nkv, hd = arch.num_attention_heads, arch.num_kv_heads, arch.head_dim
    qd, kvd = nh * hd, nkv * hd
    full = cand.finetune == "full"
    targets = {n for n, _, _ in (lora_targets(arch, settings) if not full else ())}

    def trainable(name: str) -> bool:
        return full or name in targets

    norm_w = full  # RMSNorm weights are trained only in full fine-tuning

    def rmsnorm(out_saved: bool, needs_grad: bool = True) -> int:
        if not needs_grad:  # input without grad (LoRA layer 0 sees the frozen embedding)
            return d * t * h if out_saved else 0
        x32 = 4 * t * h  # pow() saves the fp32 input (the input itself when d == 4)
        y = d * t * h if norm_w else 0  # weight * y saves y when the weight is trained
        out = d * t * h if out_saved else 0  # saved by the next (trained or adapted) linear
        return x32 + y + out + 4 * t  # + rsqrt

    names = {n for n, _, _ in param_layout(arch).linear_shapes}
    qkv_names = {"q_proj", "k_proj", "v_proj", "query_key_value"} & names
    o_name = "o_proj" if "o_proj" in names else "dense"
    up_names = {"gate_proj", "up_proj", "gate_up_proj", "dense_h_to_4h"} & names
    down_name = "down_proj" if "down_proj" in names else "dense_4h_to_h"

    layer = 0
    qkv_saved = any(trainable(n) for n in qkv_names)
    layer += rmsnorm(qkv_saved)
    # attention
    layer += d * t * qd + 2 * d * t * kvd  # rotated q, k; v
    if arch.qk_norm:  # Qwen3/Gemma-3 per-head RMSNorm on q and k before rotary
        layer += (
            4 * t * (qd + kvd) + (d * t * (qd + kvd) if norm_w else 0) + 4 * b * sq * (nh + nkv)
        )
    if cand.attn == "eager":
        probs = 4 * b * nh * sq * sq + (d * b * nh * sq * sq if d < 4 else 0)
        a.attention_scores = arch.num_layers * probs
        layer += probs
        if nkv < nh:
            layer += 2 * d * t * qd  # repeat_kv copies of k and v (saved by the two matmuls)
        if trainable(o_name):
            layer += d * t * qd  # transpose(1,2).contiguous() output saved by o_proj
    else:
        layer += d * t * qd + 4 * b * nh * sq  # kernel output (also o_proj's input) + lse
    # residual + second norm
    layer += rmsnorm(any(trainable(n) for n in up_names))
    # MLP
    if arch.gated_mlp:
        layer += 3 * d * t * i + (d * t * i if trainable(down_name) else 0)
    else:
        layer += d * t * i + (d * t * i if trainable(down_name) else 0)
    extra_norms = getattr(arch, "norms_per_layer", 2) - 2  # Gemma-3 post-norms
    layer += extra_norms * rmsnorm(False)
    if not full:
        layer += sum(d * t * cand.lora_rank for n in targets)
        if settings.lora_alpha_dropout:
            layer += sum(d * t * inn + t * inn for n, inn, _ in lora_targets(arch, settings))
    a.per_layer = layer

    # final norm, logits and the loss (HF ForCausalLMLoss / losses.token_logps):
    final = rmsnorm(full)
    # memfit's trainer (train.py `loss`) drops the model output before backward, so the logits
    # themselves are gone; log_softmax keeps its fp32 [t, V] output (losses.token_logps).
    a.logits_saved = 4 * t * V
    # loss backward: gather/nll backward's fp32 [t, V] gradient, then log_softmax_backward's
    a.logits_bwd_extra = 8 * t * V
    rope = 2 * 4 * sq * hd  # cos and sin, shared by all layers (fp32)
    ids = 3 * 8 * b * sq  # int64 input ids, attention mask and labels
    if cand.grad_ckpt:
        # torch.utils.checkpoint (non-reentrant, transformers' default) keeps each layer's input.
        # Only in train mode: `GradientCheckpointingLayer.forward_with_checkpointing`
        # (transformers modeling_layers.py) checkpoints when `self.training`, and `from_pretrained`
        # returns the model in eval mode; a trainer that never calls `.train()` keeps every
        # layer's tensors (the no-checkpointing estimate; tests/test_estimate_deepspeed.py).
        kept = arch.num_layers * d * t * h
    else:
        kept = arch.num_layers * layer
        if not full:  # layer 0's first norm sees the frozen embedding output: nothing to save
            kept -= rmsnorm(qkv_saved) - rmsnorm(qkv_saved, needs_grad=False)
    a.saved = kept + final + a.logits_saved + rope + ids
    a.final = final
    a.kept_per_layer = d * t * h if cand.grad_ckpt else layer
    # the recomputed layer shares its input with the checkpoint (no copy in fp32)
    a.recompute = layer - (4 * t * h if d == 4 else 0) if cand.grad_ckpt else 0
    # Transient gradients inside a layer's backward, on top of the layer's saved tensors.
    # MLP backward (runs first): the gradient of silu(gate)*up and of one factor (2dti) and the
    # gradient of the hidden state (dth).
    mlp_extra = 2 * d * t * i + d * t * h
    # attention backward (after the MLP's saved tensors and the second norm's are freed):
    # eager: the gradients of the probabilities and of the scores (s x s, the latter fp32);
    # sdpa/flash: the gradients of q, k and v.
    mlp_saved = (4 if arch.gated_mlp else 2) * d * t * i + rmsnorm(True)
    if cand.attn == "eager":
        # at the softmax backward: the probabilities' and the scores' gradients, the gradient of
        # v and of the hidden state; o_proj's input and the repeated v are already freed
        attn_extra = (d + 4) * b * nh * sq * sq + d * t * qd + d * t * h
        attn_extra -= d * t * qd * ((1 if trainable(o_name) else 0) + (1 if nkv < nh else 0))
    else:
        attn_extra = 2 * d * t * (qd + 2 * kvd) + 2 * d * t * h
    a.mlp_bwd, a.attn_bwd = mlp_extra, attn_extra - mlp_saved
    a.layer_bwd = max(a.mlp_bwd, a.attn_bwd)
    # Forward transients of one attention call: eager materialises the scores (matmul output,
    # scaled copy, masked copy: two alive at a time; the softmax output is fp32) next to the
    # additive mask transformers builds once per forward ([b, 1, s, s] in the model dtype,
    # masking_utils.eager_mask) and the repeat_kv'd keys/values; sdpa/flash only q, k, v, out.
    if cand.attn == "eager":
        mask = d * b * sq * sq
        attn_fwd = max(2 * d, d + 4) * b * nh * sq * sq + mask + d * t * (3 * qd + 2 * kvd)
        if cand.grad_ckpt:
            a.saved += mask  # the checkpoint keeps the mask among the layer's inputs
    else:
        attn_fwd = d * t * (2 * qd + 2 * kvd)
    a.forward = (
        kept
        - (a.kept_per_layer if not cand.grad_ckpt else 0)
        + rope
        + ids
        + attn_fwd
        + 2 * d * t * h
    )
    # DPO reference forward under no_grad, after the policy forward (memfit's train.py, as TRL and
    # OpenRLHF do): the policy's saved tensors and logits (the output is still referenced), then
    # either one reference attention call or the reference's logits, their fp32 copy in 16-bit
    # training and its log-softmax.
    if method == "dpo" and cand.ref in ("model", "adapter"):
        ref_logits = (d + (4 if d < 4 else 0) + 4) * t * V
        a.ref_forward = d * t * V + max(ref_logits, attn_fwd + 3 * d * t * h)
    return a


def traced_activations(
    arch: ModelArch, cand: Candidate, method: str, settings: Settings, analytic: _Acts
) -> _Acts:
    """The activation terms from a traced run (memfit.trace): the model's own code on fake
    tensors, 1 and 2 layers, per sequence, measured with torch's MemTracker and cached.

    Every per-layer quantity is the 2-layer minus the 1-layer run, the rest the 1-layer run
    minus one layer (trace.LayerTrace.at); everything is multiplied by the sequences of the
    micro step (DPO: chosen + rejected). The fields mean what `activations` documents, with
    recomputation folded into `layer_bwd` (the top layer's backward peak over what is kept when
    it starts). Kept from the analytic terms: the DPO reference forward (not traced: MemTracker
    follows one forward of a root module) and the eager probabilities' share for the note.
    """
    from memfit import trace

    c = cand.micro_batch * (2 if method == "dpo" else 1)
    L = arch.num_layers
    try:
        t = trace.layer_trace(
            arch,
            cand.seq_len,
            cand.attn,
            cand.precision,
            cand.grad_ckpt,
            cand.finetune,
            cand.lora_rank,
            settings.lora_targets,
            cache_dir=settings.trace_cache,
        )
    except trace.TraceError as exc:
        raise EstimateError(str(exc)) from None
    # the int64 input ids, attention mask and labels the trainer's collate makes (created
    # outside the trace's tracker) and the rotary cos/sin table shared by the batch (not in
    # the per-sequence measures): counted as `activations` counts them
    ids = 3 * 8 * c * cand.seq_len + 2 * 4 * cand.seq_len * arch.head_dim
    a = _Acts()
    a.saved = t.saved(L, c) + ids
    a.kept_per_layer = t.per_layer("saved", c)
    a.per_layer = t.per_layer("saved", c) if not cand.grad_ckpt else analytic.per_layer
    # what the loss keeps once the model output is dropped: the fp32 log-softmax and friends
    a.logits_saved = c * (t.seq("saved", 1) - (t.seq("pre_loss", 1) - t.seq("logits_bytes", 1)))
    a.logits_bwd_extra = t.at("loss_bwd_peak", L, c) + ids - a.saved
    kept = t.at("top_pre_bw", L, c) + ids  # alive when the top layer's backward starts
    a.final = a.saved - a.logits_saved - kept
    a.recompute = 0  # folded into layer_bwd, which is measured with the recomputation in it
    a.layer_bwd = t.at("top_peak_bw", L, c) + ids - kept
    a.mlp_bwd = t.at("top_mlp_peak_bw", L, c) + ids - kept
    a.attn_bwd = t.at("top_attn_peak_bw", L, c) + ids - kept
    a.forward = t.at("fwd_peak", L, c) + ids
    a.attention_scores = analytic.attention_scores
    a.ref_forward = analytic.ref_forward
    return a


# ---------------------------------------------------------------------------------------------
# The estimate


def _device_overheads(gpu: GPU, world: int, ranks_per_node: int) -> dict[str, int]:
    """Memory nvidia-smi shows that no tensor holds. Heuristics, stated:
    - CUDA context with lazy module loading (CUDA >= 11.7): ~300-500 MiB; 500 MiB on sm80+,
      400 MiB before (PyTorch docs, "CUDA semantics: memory management" and measured
      torch.cuda.mem_get_info deltas reported in PyTorch issue 20532);
    - cuBLAS workspace: CUBLAS_WORKSPACE_CONFIG default 4 MiB x 2 + 16 KiB x 8 per handle, 32 MiB
      on Hopper (PyTorch `getChosenWorkspaceSize`); counted as allocated by PyTorch >= 2.1? no:
      it is reserved by the allocator, we count it here once;
    - NCCL: ~ 2 x NCCL_BUFFSIZE (4 MiB) per channel per peer; ~ 256 MiB for an 8-GPU ring.
    """
    cal = calibration.for_gpu(gpu.name, gpu.compute_capability)  # defaults: the values above
    nccl = 0 if world == 1 else min(cal.nccl_max_bytes, cal.nccl_bytes_per_peer * (world - 1))
    return {"cuda_context": cal.cuda_context_bytes, "cublas": cal.cublas_workspace_bytes, "nccl": nccl}


def _fragmentation(transient: int, settings: Settings, is_cpu: bool) -> int:
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


def estimate(
    arch: ModelArch,
    gpu: GPU,
    num_gpus: int = 1,
    num_nodes: int = 1,
    method: str = "sft",
    cand: Candidate | None = None,
    host_memory_gb: float | None = None,
    budget_bytes: int | None = None,
    settings: Settings = DEFAULT_SETTINGS,
) -> Estimate:
    """Predict one configuration on `num_gpus` GPUs per node x `num_nodes` nodes.

    `budget_bytes` replaces the device's memory (the demo's `cpu` entry, or a headroom budget).
    Invalid hardware combinations return `Estimate(invalid=True, reason=...)`; bad input raises
    `EstimateError`.
    """
    cand = cand or Candidate()
    if method not in ("sft", "dpo"):
        raise EstimateError(f"method must be sft or dpo, got {method!r}")
    if num_gpus < 1 or num_nodes < 1:
        raise EstimateError(f"num_gpus and num_nodes must be >= 1, got {num_gpus} and {num_nodes}")
    if method == "dpo" and cand.ref == "adapter" and cand.finetune == "full":
        raise EstimateError("ref=adapter needs finetune=lora or qlora")
    _check_arch(arch)
    est = Estimate()
    lay = param_layout(arch)
    est.params_total = lay.total
    est.params_trainable = trainable_params(arch, cand, settings)
    host_gb = host_memory_gb if host_memory_gb is not None else gpu.typical_host_memory_gb
    is_cpu = gpu.name == "cpu"
    est.device_memory_bytes = int(budget_bytes if budget_bytes is not None else gpu.memory_bytes)
    # On `cpu` the device is the host: one pool, unless the caller gives a per-rank tensor
    # budget (the workflow's `cpu_memory_mib`), which is then checked like a GPU's memory.
    one_pool = is_cpu and budget_bytes is None
    est.host_memory_bytes = est.device_memory_bytes if one_pool else int(host_gb * 1e9)
    problems = hardware_problems(gpu, cand)
    if problems:
        est.invalid, est.reason = True, "; ".join(problems)
        return est
    world = num_gpus * num_nodes
    d = _dtype_bytes(cand.precision)
    st = model_states(arch, cand, world, num_gpus, settings, method)
    ac = activations(arch, cand, method, settings)
    if settings.activations == "traced":
        ac = traced_activations(arch, cand, method, settings, ac)
        est.activations_source = "traced"
        if cand.attn == "flash":
            est.notes.append(
                "activations traced with sdpa: FlashAttention-2 cannot run on the CPU; SDPA's CPU "
                "kernel keeps the same tensors (output and log-sum-exp)"
            )
        if cand.finetune == "qlora":
            est.notes.append("activations traced as LoRA: bitsandbytes' 4-bit kernels need CUDA")
    elif settings.activations != "analytic":
        raise EstimateError(f"activations must be analytic or traced, got {settings.activations!r}")
    est.notes += st.notes
    T = est.params_trainable

    static = st.params + st.grads + st.optimizer + st.buckets
    gathered = st.gathered
    # -- forward/backward: the peak is at the loss backward (all activations + logit gradients)
    # or inside the first or last layer's backward (gradients grow while activations shrink).
    head_grad = (d * lay.lm_head if cand.finetune == "full" else 0) if cand.zero < 2 else 0
    layer_grad = 0
    if cand.zero < 2:  # ZeRO-2/3 move gradients into their partitions as they arrive
        layer_grad = d * (lay.per_layer if cand.finetune == "full" else T // arch.num_layers)
    # while the layers run backward, the logits and the final norm's tensors are gone
    layers_kept = ac.saved - ac.logits_saved - ac.final
    p_loss = ac.saved + ac.logits_bwd_extra
    # inside a layer's backward the weight gradients of that layer appear part by part: at the
    # MLP's peak only down_proj's, at the attention's the MLP's and o_proj's
    if layer_grad and cand.finetune == "full":
        mlp_lin = sum(i * o for n, i, o in lay.linear_shapes if n in ("down_proj", "dense_4h_to_h"))
        att_lin = sum(
            i * o
            for n, i, o in lay.linear_shapes
            if n not in ("q_proj", "k_proj", "v_proj", "query_key_value")
        )
        inlayer = max(ac.mlp_bwd + d * mlp_lin, ac.attn_bwd + d * (att_lin + arch.hidden_size))
    else:
        inlayer = ac.layer_bwd + layer_grad
    # Tied embeddings, full fine-tuning: the head's [V, h] weight gradient waits in autograd's
    # input buffer of the shared weight's AccumulateGrad until the embedding's backward adds its
    # share (torch/csrc/autograd/input_buffer.cpp accumulates; engine.cpp runs a node once all
    # its inputs arrived), i.e. through every layer's backward, at every ZeRO stage (DeepSpeed's
    # gradient hooks fire at accumulation). Seen by the traced run (memfit.trace, real and fake
    # tensors alike: a TEMP [V, h] tensor at each layer's backward).
    tied_pending = d * lay.embed if (cand.finetune == "full" and arch.tie_word_embeddings) else 0
    p_top = layers_kept + ac.recompute + inlayer + head_grad + tied_pending
    grads_bottom = head_grad + (arch.num_layers - 1) * layer_grad
    p_bottom = (
        layers_kept
        - (arch.num_layers - 1) * ac.kept_per_layer
        + ac.recompute
        + inlayer
        + grads_bottom
        + tied_pending
    )
    dyn_grads_all = st.grads_dynamic
    if cand.finetune == "full" and cand.zero < 2:
        # embedding_dense_backward's [V, h] gradient arrives last (twice when tied: accumulated)
        p_end = dyn_grads_all + (d * lay.embed if arch.tie_word_embeddings else 0)
    else:
        p_end = 0
    fb_parts = {
        "forward": ac.forward,
        "loss_backward": p_loss,
        "top_layer_backward": p_top,
        "bottom_layer_backward": p_bottom,
        "backward_end": p_end,
    }
    # -- gradients that outlive the micro step they were produced in (DeepSpeed engines):
    # ZeRO-0, grad_accum > 1: runtime/engine.py `DeepSpeedEngine.step` calls `_take_model_step`
    # (optimizer.step + zero_grad) only at `is_gradient_accumulation_boundary()`, so the plain
    # torch optimizer's param.grad (d*T) stays allocated through the next micro steps' forward and
    # backward, and autograd accumulates into it (no new full-size gradient per micro step).
    # ZeRO-3: runtime/zero/stage3.py `reduce_independent_p_g_buckets_and_remove_grads` /
    # `__add_grad_to_ipg_bucket` keep a parameter's full-size gradient referenced until its bucket
    # is reduce-scattered (`__reduce_and_partition_ipg_grads` -> `partition_grads` sets
    # param.grad = None); on the 2-rank gloo probes (tests/test_estimate_deepspeed.py) nearly all
    # of d*T is live at the backward's peak, in every micro step (grad_accum 1 and 4 alike), so
    # the whole d*T is counted. ZeRO-1/2 copy gradients into their partitions as they arrive
    # (stage_1_and_2.py `reduce_independent_p_g_buckets_and_remove_grads`): nothing held.
    held_grads = 0
    if cand.zero == 0 and cand.grad_accum > 1:
        held_grads = d * T
        counted = {"top_layer_backward": head_grad, "bottom_layer_backward": grads_bottom}
        for k in ("forward", "loss_backward", "top_layer_backward", "bottom_layer_backward"):
            fb_parts[k] += held_grads - counted.get(k, 0)
    elif cand.zero == 3 and gpu.name == "cpu":
        # Measured on DeepSpeed's CPU accelerator only. On CUDA, overlap_comm reduce-scatters each
        # full bucket on a side stream and frees its gradients (ZeRO paper Sec. 5.2: gradients are
        # reduced as they are produced), so only the buckets are live; not yet measured on a GPU
        # here, so GPUs keep the bucket-only term rather than this CPU observation.
        held_grads = d * T
        for k in fb_parts:
            fb_parts[k] += held_grads

    # -- optimizer step: all gradients present; torch's single-tensor AdamW holds sqrt(v) and the
    # denominator for the largest tensor, foreach AdamW a full copy of v (torch/optim/adamw.py
    # `_multi_tensor_adamw`: torch._foreach_sqrt), DeepSpeed's FusedAdam nothing.
    impl = settings.optimizer_impl or ("single" if is_cpu else "fused")
    on_dev = (
        st.optimizer_resident_fraction
        if cand.zero == 3
        else (0.0 if cand.offload_optimizer == "cpu" else 1.0)
    )
    biggest_T = (
        lay.largest_module
        if cand.finetune == "full"
        else max(cand.lora_rank * max(i, o) for _, i, o in lora_targets(arch, settings))
    )
    opt_tmp = {"single": 2 * 4 * biggest_T, "foreach": 4 * T, "fused": 0}[impl]
    if cand.zero >= 1:
        opt_tmp = 0 if impl == "fused" else int(opt_tmp * on_dev / max(world, 1))
    optimizer_step = static + dyn_grads_all + int(opt_tmp * (on_dev if cand.zero == 0 else 1))

    # -- resume: torch.optim.Optimizer.load_state_dict copies each saved state to the parameter's
    # device before the old state is dropped, so m and v of the device-resident part exist twice.
    # DeepSpeed ZeRO-1/2/3 create their optimizer states at initialisation
    # (`initialize_optimizer_states`); at stage 0 torch's Adam creates them lazily, so loading
    # fills empty slots.
    resume = static + (int(8 * T / world * on_dev) if cand.zero >= 1 else 0)

    # -- DPO reference forward (no_grad) after the policy forward
    ref_fw = static + gathered + ac.saved + ac.ref_forward if ac.ref_forward else 0

    phases = {
        **{k: static + gathered + v for k, v in fb_parts.items()},
        "optimizer_step": optimizer_step,
        "resume": resume,
    }
    if ref_fw:
        phases["reference_forward"] = ref_fw
    est.phases = {k: int(v) for k, v in phases.items()}
    est.peak_phase = max(phases, key=phases.get)
    peak = phases[est.peak_phase]
    est.peak_allocated_bytes = int(peak)

    # breakdown at the peak phase
    bd = {
        "params": st.params,
        "grads": st.grads,
        "optimizer": st.optimizer,
        "activations": 0,
        "logits": 0,
        "reference": 0,
        "temporaries": st.buckets,
        "overheads": 0,
    }
    if method == "dpo" and cand.ref == "model":
        ref_part = st.params - (st.params * 0)  # split below
        ratio_ref = 0.5 if cand.finetune == "full" else None
        if ratio_ref is None:
            # params = weights + adapters + ref weights; ref weights = the weights
            total_w = st.params
            adapter = (T * d) // (world if cand.zero == 3 else 1)
            ref_part = (total_w - adapter) // 2
        else:
            ref_part = st.params // 2
        bd["params"] -= ref_part
        bd["reference"] = ref_part
    if est.peak_phase in fb_parts:
        fb_where = est.peak_phase
        bd["temporaries"] += gathered
        if fb_where == "forward":
            bd["grads"] += held_grads
            bd["activations"] = ac.forward
        elif fb_where == "loss_backward":
            bd["grads"] += held_grads
            bd["activations"] = ac.saved - ac.logits_saved
            bd["logits"] = ac.logits_saved + ac.logits_bwd_extra
        elif fb_where == "backward_end":
            extra = held_grads if cand.zero == 3 else 0
            bd["grads"] += dyn_grads_all + extra
            bd["temporaries"] += p_end - dyn_grads_all
        else:
            fb_dynamic = fb_parts[fb_where]
            g = head_grad if fb_where == "top_layer_backward" else grads_bottom
            g = (held_grads if held_grads else g) + tied_pending
            bd["grads"] += g
            bd["activations"] = fb_dynamic - g
    elif est.peak_phase == "optimizer_step":
        bd["grads"] += dyn_grads_all
        bd["temporaries"] += optimizer_step - static - dyn_grads_all
    elif est.peak_phase == "resume":
        bd["optimizer"] += resume - static
    else:
        bd["temporaries"] += gathered + ac.ref_forward
        bd["activations"] = ac.saved - ac.logits_saved
        bd["logits"] = ac.logits_saved
        bd["reference"] += 0

    # reserved: fragmentation of the shape-varying part
    transient = ac.saved + ac.logits_bwd_extra + ac.layer_bwd + ac.recompute
    frag = _fragmentation(transient, settings, is_cpu)
    cal_frag = calibration.for_gpu(gpu.name, gpu.compute_capability).fragmentation
    if cal_frag is not None and not is_cpu:  # measured reserved/allocated - 1 at the peak
        frag = int(cal_frag * est.peak_allocated_bytes)
    est.peak_reserved_bytes = est.peak_allocated_bytes + frag
    ov = _device_overheads(gpu, world, num_gpus)
    est.device_total_bytes = est.peak_reserved_bytes + sum(ov.values())
    est.calibration = calibration.for_gpu(gpu.name, gpu.compute_capability).label()
    bd["overheads"] = frag + sum(ov.values())
    est.breakdown = {k: int(v) for k, v in bd.items()}
    if cand.attn == "eager":
        # what the materialised scores cost: the same configuration with a fused kernel
        fused = estimate(
            arch,
            gpu,
            num_gpus,
            num_nodes,
            method,
            dataclasses.replace(cand, attn="sdpa"),
            host_memory_gb,
            budget_bytes,
            settings,
        )
        est.eager_attention_extra_bytes = est.device_total_bytes - fused.device_total_bytes
        kept = "one recomputed layer's" if cand.grad_ckpt else "every layer's"
        est.notes.append(
            f"eager attention keeps {kept} {cand.seq_len}x{cand.seq_len} attention probabilities: "
            f"+{est.eager_attention_extra_bytes / GIB:.2f} GiB on the device versus sdpa/flash"
        )

    # host RAM per node
    hb, hph = _host(arch, cand, gpu, st, num_gpus, world, settings, est.peak_allocated_bytes)
    est.host_breakdown, est.host_phases = hb, hph
    est.host_bytes = max(hph.values())
    if one_pool:
        # the "device" is the host: every rank's peak plus the processes' own memory
        need = num_gpus * est.device_total_bytes + est.host_bytes
        est.margin_bytes = est.device_memory_bytes - need
        est.host_margin_bytes = est.margin_bytes
        est.fits = est.margin_bytes >= 0
    else:
        est.margin_bytes = est.device_memory_bytes - est.device_total_bytes
        est.host_margin_bytes = est.host_memory_bytes - est.host_bytes
        est.fits = est.margin_bytes >= 0 and est.host_margin_bytes >= 0
    est.time_breakdown = step_time(arch, cand, gpu, method, num_gpus, num_nodes, st, settings)
    est.step_time_s = round(sum(est.time_breakdown.values()), 6)
    tokens = (
        cand.micro_batch * cand.seq_len * cand.grad_accum * world * (2 if method == "dpo" else 1)
    )
    est.tokens_per_s = tokens / est.step_time_s if est.step_time_s > 0 else 0.0
    return est


def _host(
    arch, cand, gpu, st: _States, ranks_per_node, world, settings, device_peak
) -> tuple[dict, dict]:
    """Host RAM per node. Per rank: the process itself (CUDA/NCCL/Python, ~3 GiB on GPU nodes,
    0.6 GiB for a CPU rank: measured RSS of `import deepspeed, transformers`), the offloaded
    states, pinned buffers (power-of-two rounded), and the transient phases:
    - load: from_pretrained reads safetensors through mmap (page cache shared by the node's ranks)
    - resume: every rank torch.load()s its optimizer shard (12 T / N fp32: master, m, v) and for
      ZeRO-0/1/2 the whole 16-bit module state (mp_rank_00_model_states.pt) at the same time
    - save: the same tensors copied to host memory by torch.save."""
    is_cpu = gpu.name == "cpu"
    g = ranks_per_node
    d = _dtype_bytes(cand.precision)
    P = param_layout(arch).total
    T = trainable_params(arch, cand, settings)
    proc = int((0.6 if is_cpu else 3.0) * GIB)
    offl = st.host_optimizer + st.host_params
    pinned_extra = st.host_pinned
    steady = g * (proc + offl + pinned_extra)
    shard = 12 * T // (world if cand.zero >= 1 else 1)
    module_file = d * P if cand.zero < 3 else d * P // world
    resume = steady + g * (shard + module_file)
    load = steady + d * P
    init_pin = g * st.host_pin_source if cand.pin_memory else 0
    phases = {"steady": steady, "load": load, "resume": resume, "init": steady + init_pin}
    bd = {
        "process": g * proc,
        "offloaded_optimizer": g * st.host_optimizer,
        "offloaded_params": g * st.host_params,
        "pinned_rounding": g * pinned_extra,
        "checkpoint_resume": g * (shard + module_file),
    }
    return {k: int(v) for k, v in bd.items()}, {k: int(v) for k, v in phases.items()}


def step_time(
    arch, cand, gpu: GPU, method, num_gpus, num_nodes, st: _States, settings
) -> dict[str, float]:
    """Seconds per optimizer step, good enough to rank candidates (calibrated by probes later).

    compute: 6 FLOPs per parameter per token (Kaplan et al. 2020, sec. 2.1) plus attention
    12*L*s*h per token (causal: half), 8/6 with recomputation (Korthikanti et al. 2022, sec. 5);
    LoRA skips weight gradients (4 instead of 6); DPO's reference adds a forward (2).
    offload: gradients down and parameters up over the host link, DeepSpeedCPUAdam's step.
    ZeRO-3: all-gather of the parameters in forward and backward (and recompute), reduce-scatter
    of gradients (ZeRO paper sec. 7: 1.5x the all-reduce volume).
    """
    lay = param_layout(arch)
    world = num_gpus * num_nodes
    d = _dtype_bytes(cand.precision)
    P = lay.total
    T = trainable_params(arch, cand, settings)
    seqs = cand.micro_batch * (2 if method == "dpo" else 1)
    tokens = seqs * cand.seq_len
    nonembed = P - lay.embed
    per_tok_fwd = (
        2 * nonembed + 2 * arch.num_layers * cand.seq_len * arch.num_attention_heads * arch.head_dim
    )
    mult = 3.0 if cand.finetune == "full" else 2.0
    if cand.grad_ckpt:
        mult += 1.0
    flops = per_tok_fwd * tokens * mult
    if method == "dpo" and cand.ref in ("model", "adapter"):
        flops += per_tok_fwd * tokens
    peak = gpu.tflops(cand.precision) * 1e12
    if peak <= 0:
        peak = gpu.tflops_fp32 * 1e12
    eff = settings.mfu * (0.7 if cand.attn == "eager" else 1.0)
    achieved = calibration.for_gpu(gpu.name, gpu.compute_capability).tflops.get("step")
    if achieved:  # measured model-FLOP rate of the whole step replaces peak x mfu
        peak, eff = achieved * 1e12, (0.7 if cand.attn == "eager" else 1.0)
    compute = cand.grad_accum * flops / (peak * eff)
    bw_intra = gpu.interconnect_gbs * 1e9
    bw = min(bw_intra, settings.internode_gbs * 1e9 * num_gpus) if num_nodes > 1 else bw_intra
    comm = 0.0
    if world > 1:
        if cand.zero == 3:
            passes = 3 if cand.grad_ckpt else 2
            comm += cand.grad_accum * passes * d * P * (world - 1) / world / bw
            comm += cand.grad_accum * d * T * (world - 1) / world / bw
        else:
            comm += 2 * d * T * (world - 1) / world / bw
            if cand.zero >= 1:
                comm += d * T * (world - 1) / world / bw  # all-gather of updated params
    offload = 0.0
    if cand.offload_optimizer == "cpu":
        frac = st.offload_fraction if cand.zero == 3 else 1.0
        link = gpu.host_link_gbs * 1e9
        offload += frac * (4 + d) * T / world / link  # fp32 grads down, 16-bit params up
        offload += frac * T * num_gpus / world / settings.cpu_adam_params_per_s
    if cand.offload_param == "cpu":
        passes = 3 if cand.grad_ckpt else 2
        offload += cand.grad_accum * passes * d * P / world / (gpu.host_link_gbs * 1e9)
    # a step's fixed overhead (launches, Python, optimizer bookkeeping)
    overhead = 0.005 * arch.num_layers / 32 * cand.grad_accum + 0.01
    opt = (
        0.0
        if cand.offload_optimizer == "cpu"
        else 16 * T / world / (gpu.memory_bandwidth_gbs * 1e9)
    )
    return {
        "compute": compute,
        "communication": comm,
        "offload": offload,
        "optimizer": opt,
        "overhead": overhead,
    }


def _check_arch(arch: ModelArch) -> None:
    missing = [
        f
        for f in (
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
        )
        if not isinstance(getattr(arch, f, None), int) or getattr(arch, f) <= 0
    ]
    if missing:
        raise EstimateError(
            f"model {arch.name!r} lacks {', '.join(missing)}: the estimate needs them"
        )


# ---------------------------------------------------------------------------------------------
# The search space (used by the workflow's estimate_candidates rule)


def estimate_space(
    arch: ModelArch,
    gpu: GPU,
    num_gpus: int,
    num_nodes: int,
    method: str,
    candidates,
    host_memory_gb: float | None = None,
    budget_bytes: int | None = None,
    settings: Settings = DEFAULT_SETTINGS,
) -> list[dict[str, Any]]:
    """`estimate()` of every candidate: the estimate JSON plus "candidate" and "id"."""
    candidates = list(candidates)
    if settings.activations == "traced":
        prefetch_traces(arch, gpu, candidates, settings)
    out = []
    for cand in candidates:
        e = estimate(
            arch, gpu, num_gpus, num_nodes, method, cand, host_memory_gb, budget_bytes, settings
        )
        row = e.to_dict()
        row["candidate"] = cand.to_dict()
        row["id"] = cand.id
        out.append(row)
    return out


def prefetch_traces(arch: ModelArch, gpu: GPU, candidates, settings: Settings) -> None:
    """Trace every shape the candidates need that is not cached yet, in one batch of child
    processes (memfit.trace.layer_traces), so a new architecture's space pays one interpreter
    start per worker."""
    from memfit import trace

    reqs = {}
    for c in candidates:
        if hardware_problems(gpu, c):
            continue
        for attn in {c.attn, "sdpa"} if c.attn == "eager" else {c.attn}:
            r = trace.TraceRequest(
                c.seq_len,
                trace.traced_attn(attn),
                c.precision,
                c.grad_ckpt,
                trace.traced_finetune(c.finetune),
                c.lora_rank,
                settings.lora_targets,
            )
            reqs[r] = None
    try:
        trace.layer_traces(arch, list(reqs), cache_dir=settings.trace_cache)
    except trace.TraceError as exc:
        raise EstimateError(str(exc)) from None


# ---------------------------------------------------------------------------------------------
# fit: the largest seq_len or micro_batch that fits


def fit(
    arch: ModelArch,
    gpu: GPU,
    num_gpus: int,
    num_nodes: int,
    method: str,
    cand: Candidate,
    maximize: str,
    host_memory_gb: float | None = None,
    budget_bytes: int | None = None,
    settings: Settings = DEFAULT_SETTINGS,
    upper: int | None = None,
) -> tuple[int, Estimate | None]:
    """Binary search for the largest `maximize` value that fits (memory grows monotonically in
    both). Returns (0, None) when even 1 does not fit."""
    if maximize not in ("seq_len", "micro_batch"):
        raise EstimateError(f"--maximize must be seq_len or micro_batch, got {maximize!r}")
    hi = upper or (arch.max_position_embeddings if maximize == "seq_len" else 65536)

    def at(v: int) -> Estimate:
        c = dataclasses.replace(cand, **{maximize: v})
        return estimate(
            arch, gpu, num_gpus, num_nodes, method, c, host_memory_gb, budget_bytes, settings
        )

    first = at(1)
    if first.invalid:
        return 0, first
    if not first.fits:
        return 0, first
    top = at(hi)
    if top.fits:
        return hi, top
    lo, best = 1, first
    while hi - lo > 1:
        mid = (lo + hi) // 2
        e = at(mid)
        if e.fits:
            lo, best = mid, e
        else:
            hi = mid
    return lo, best


# ---------------------------------------------------------------------------------------------
# CLI


def _parser(prog: str, maximize: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Largest seq_len or micro_batch that fits."
            if maximize
            else "Predict peak GPU memory, host memory and step time of one fine-tuning configuration."
        ),
    )
    if maximize:
        p.add_argument("--maximize", required=True, choices=["seq_len", "micro_batch"])
    p.add_argument(
        "--model", required=True, help="catalog name, a HF config.json, or a model directory"
    )
    p.add_argument("--gpu", required=True, help="GPU catalog name, or cpu")
    p.add_argument("--num-gpus", type=int, default=1, help="GPUs (ranks) per node")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--method", choices=["sft", "dpo"], default="sft")
    p.add_argument("--finetune", choices=["full", "lora", "qlora"], default="full")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument(
        "--lora-targets",
        default=None,
        help="comma-separated linear names (default: every linear of the decoder layer)",
    )
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--grad-ckpt", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--attn", choices=["flash", "sdpa", "eager"], default="flash")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=3)
    p.add_argument("--offload-optimizer", choices=["none", "cpu"], default="none")
    p.add_argument("--offload-param", choices=["none", "cpu"], default="none")
    p.add_argument("--pin-memory", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--offload-ratio", type=float, default=1.0)
    p.add_argument(
        "--sub-group-size",
        type=int,
        default=DEFAULT_SETTINGS.sub_group_size,
        help="ZeRO-3 optimizer sub-group size, elements",
    )
    p.add_argument(
        "--ref",
        choices=["precomputed", "model", "adapter"],
        default=None,
        help="DPO reference (default: model for full, adapter for LoRA)",
    )
    p.add_argument("--host-memory-gb", type=float, default=None, help="RAM per node, GB")
    p.add_argument(
        "--budget-gb", type=float, default=None, help="use this many GB as the device memory"
    )
    p.add_argument(
        "--expandable-segments",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    )
    p.add_argument(
        "--activations",
        choices=["analytic", "traced"],
        default="analytic",
        help="activation terms from formulas, or from a traced CPU run of the model's code "
        "(fake tensors, cached per shape; memfit.trace)",
    )
    p.add_argument(
        "--trace-cache",
        default=None,
        help="traced: cache directory (default $MEMFIT_TRACE_CACHE or ~/.cache/memfit/traces)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return p


def _from_args(args) -> tuple[ModelArch, GPU, Candidate, Settings]:
    try:
        arch = catalog.model(args.model)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        raise EstimateError(str(exc).strip("'\"")) from None
    try:
        g = catalog.gpu(args.gpu)
    except (ValueError, KeyError) as exc:
        raise EstimateError(str(exc).strip("'\"")) from None
    ref = args.ref or ("model" if args.finetune == "full" else "adapter")
    if args.method == "sft":
        ref = "precomputed" if ref == "adapter" and args.finetune == "full" else ref
    try:
        cand = Candidate(
            zero=args.zero,
            offload_optimizer=args.offload_optimizer,
            offload_param=args.offload_param,
            pin_memory=args.pin_memory,
            offload_ratio=args.offload_ratio,
            grad_ckpt=args.grad_ckpt,
            attn=args.attn,
            finetune=args.finetune,
            lora_rank=args.lora_rank,
            micro_batch=args.micro_batch,
            seq_len=args.seq_len,
            grad_accum=args.grad_accum,
            precision=args.precision,
            ref=ref,
        )
    except ValueError as exc:
        raise EstimateError(str(exc)) from None
    targets = tuple(t.strip() for t in args.lora_targets.split(",")) if args.lora_targets else None
    settings = dataclasses.replace(
        DEFAULT_SETTINGS,
        lora_targets=targets,
        sub_group_size=args.sub_group_size,
        expandable_segments=args.expandable_segments,
        activations=args.activations,
        trace_cache=args.trace_cache,
    )
    return arch, g, cand, settings


def _gib(n: int | float) -> str:
    return f"{n / GIB:,.2f} GiB"


def render(
    e: Estimate,
    arch: ModelArch,
    g: GPU,
    cand: Candidate,
    num_gpus: int,
    num_nodes: int,
    method: str,
) -> str:
    """The human-readable table."""
    lines = [
        f"{arch.name} {method} {cand.finetune} on {num_nodes}x{num_gpus} {g.name}  [{cand.id}]",
        f"params {e.params_total / 1e9:.3f} B total, {e.params_trainable / 1e9:.4f} B trainable",
    ]
    if e.invalid:
        lines.append(f"INVALID: {e.reason}")
        return "\n".join(lines)
    lines.append("")
    src = "; activations traced" if e.activations_source == "traced" else ""
    lines.append(f"per GPU at the peak ({e.peak_phase.replace('_', ' ')}{src}):")
    for k, v in e.breakdown.items():
        lines.append(f"  {k:<14}{_gib(v):>14}")
    lines.append(
        f"  {'allocated':<14}{_gib(e.peak_allocated_bytes):>14}   (torch.cuda.max_memory_allocated)"
    )
    lines.append(
        f"  {'reserved':<14}{_gib(e.peak_reserved_bytes):>14}   (torch.cuda.max_memory_reserved)"
    )
    lines.append(
        f"  {'device total':<14}{_gib(e.device_total_bytes):>14}   (nvidia-smi) of {_gib(e.device_memory_bytes)}"
    )
    lines.append(
        "allocated by phase: "
        + ", ".join(f"{k.replace('_', ' ')} {v / GIB:.1f}" for k, v in e.phases.items())
        + " GiB"
    )
    lines.append(
        f"host RAM per node {_gib(e.host_bytes)} of {_gib(e.host_memory_bytes)}"
        f"  (peak in {max(e.host_phases, key=e.host_phases.get)})"
    )
    lines.append(f"step time {e.step_time_s:.3f} s  ({e.tokens_per_s:,.0f} tokens/s)")
    lines.append(f"calibration: {e.calibration}")
    for n in e.notes:
        lines.append(f"note: {n}")
    verdict = "FITS" if e.fits else "DOES NOT FIT"
    why = []
    if e.margin_bytes < 0:
        why.append(f"device short by {_gib(-e.margin_bytes)}")
    else:
        why.append(f"device margin {_gib(e.margin_bytes)}")
    if g.name != "cpu":
        why.append(
            f"host short by {_gib(-e.host_margin_bytes)}"
            if e.host_margin_bytes < 0
            else f"host margin {_gib(e.host_margin_bytes)}"
        )
    lines.append(f"verdict: {verdict} ({', '.join(why)})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`memfit estimate`: exit 0 when it fits, 1 when it does not, 2 on bad input or an
    invalid hardware combination."""
    args = _parser("memfit estimate", False).parse_args(argv)
    try:
        arch, g, cand, settings = _from_args(args)
        budget = int(args.budget_gb * 1e9) if args.budget_gb else None
        e = estimate(
            arch,
            g,
            args.num_gpus,
            args.num_nodes,
            args.method,
            cand,
            args.host_memory_gb,
            budget,
            settings,
        )
    except EstimateError as exc:
        print(f"memfit estimate: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(e.to_dict(), indent=2))
    else:
        print(render(e, arch, g, cand, args.num_gpus, args.num_nodes, args.method))
    if e.invalid:
        print(f"memfit estimate: invalid: {e.reason}", file=sys.stderr)
        return 2
    return 0 if e.fits else 1


def fit_main(argv: list[str] | None = None) -> int:
    """`memfit fit --maximize seq_len|micro_batch`: the largest value that fits."""
    args = _parser("memfit fit", True).parse_args(argv)
    try:
        arch, g, cand, settings = _from_args(args)
        budget = int(args.budget_gb * 1e9) if args.budget_gb else None
        best, e = fit(
            arch,
            g,
            args.num_gpus,
            args.num_nodes,
            args.method,
            cand,
            args.maximize,
            args.host_memory_gb,
            budget,
            settings,
        )
    except EstimateError as exc:
        print(f"memfit fit: error: {exc}", file=sys.stderr)
        return 2
    if e is not None and e.invalid:
        print(f"memfit fit: invalid: {e.reason}", file=sys.stderr)
        if args.json:
            print(json.dumps({args.maximize: 0, **e.to_dict()}, indent=2))
        return 2
    if args.json:
        print(json.dumps({args.maximize: best, **(e.to_dict() if e else {})}, indent=2))
    else:
        if best == 0:
            print(f"nothing fits: even {args.maximize}=1 needs more memory")
            if e is not None:
                print(
                    render(
                        e,
                        arch,
                        g,
                        dataclasses.replace(cand, **{args.maximize: 1}),
                        args.num_gpus,
                        args.num_nodes,
                        args.method,
                    )
                )
        else:
            print(f"largest {args.maximize} that fits: {best}\n")
            print(
                render(
                    e,
                    arch,
                    g,
                    dataclasses.replace(cand, **{args.maximize: best}),
                    args.num_gpus,
                    args.num_nodes,
                    args.method,
                )
            )
    return 0 if best > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
