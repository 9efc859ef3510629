"""The time of one optimizer step: its FLOPs, the modelled step (on a GPU each operation at its
roofline, memfit.estimate.time.roofline; on the cpu device a fixed MFU), communication, offload
and the optimizer. The numbers are stated heuristics, each with its source (what the step holds
besides its tensors: memfit.estimate.memory.overheads)."""

from __future__ import annotations

from memfit.estimate.memory.method_terms import grad_seqs, lm_head, nograd_seqs
from memfit.estimate.memory.offload_activations import checkpoint_input_bytes
from memfit.estimate.memory.states import ModelStates
from memfit.estimate.models import calibration
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.models.catalog import GPU
from memfit.estimate.models.params import param_layout, trainable_params
from memfit.estimate.settings import DEFAULT_SETTINGS, Settings, dtype_bytes
from memfit.estimate.time import roofline, runtime_costs, timing
from memfit.space import Candidate


def step_flops(
    arch: ModelArch,
    cand: Candidate,
    method: str,
    recompute: bool = True,
    settings: Settings | None = None,
    seq_len: float | None = None,
) -> float:
    """FLOPs of one optimizer step on one rank: 6 per parameter per token (Kaplan et al. 2020,
    sec. 2.1) plus attention 12*L*s*h per token (causal: half), 8/6 with recomputation of the
    layers (Korthikanti et al. 2022, sec. 5; the head is not recomputed, and counts as a matmul
    when tied to the embedding); LoRA skips weight gradients (4 instead of 6); DPO's reference
    adds a forward (2). tests/test_inventory.py checks this against FlopCounterMode on the traced
    step of the same model. `seq_len`: tokens per sequence other than the candidate's (the data's
    mean or a padded micro batch's expected longest row, `data_scale.data_scale`). padding_free
    under eager: the one row's block-causal mask is a dense [T, T] mask to eager's matmul, so a
    token attends over the whole row of the micro step's T tokens, masked (transformers
    masking_utils.py `eager_mask`); flash-attention's varlen kernel (cu_seqlens) and memfit's
    per-sequence sdpa (memfit.train.varlen_attention) over its own sequence only. Mixture-of-experts: a token runs through its top-k routed
    experts only, so the parameters are the ACTIVE ones (`ModelArch.num_active_params()`; Fedus
    et al. 2022, Switch Transformer, sec. 2: FLOPs per token follow the active parameters);
    routing's own FLOPs (softmax, top-k) are negligible. `recompute=False` leaves out what
    checkpointing and the chunked loss compute again: the model FLOPs of MFU (Chowdhery et al.
    2022, appendix B), not the hardware FLOPs.

    Generic cards (no formulas: memfit.estimate.models.generic), given `settings`: counted on the
    traced step instead (`traced.traced_step_flops`), so linear attention, sliding windows,
    latent attention and MoE routing cost what the model's code computes."""
    if arch.generic and settings is not None:
        from memfit.estimate.trace.traced import traced_step_flops

        flops = traced_step_flops(arch, cand, method, settings, recompute)
        if (cand.loss_impl == "chunked" or cand.kernels == "liger") and recompute and lm_head(method):
            flops += cand.grad_accum * 2 * arch.hidden_size * arch.vocab_size * grad_seqs(cand, method) * cand.seq_len
        return flops
    layout = param_layout(arch)
    s = cand.seq_len if seq_len is None else seq_len
    tokens = grad_seqs(cand, method) * s  # forward and backward
    # forward only: KTO's KL batch through the policy, a reference model's forwards (DPO, KTO)
    nograd_tokens = nograd_seqs(cand, method) * s
    # a token attends over the whole sequence; with Ulysses a rank holds seq_len / SP of them
    # (core.per_rank) and attends for heads / SP over all seq_len: per rank the same as its
    # tokens over seq_len x SP attended positions
    attended = s * cand.sequence_parallel
    if cand.padding_free and cand.attn == "eager":  # over the whole row (above)
        attended = grad_seqs(cand, method) * s
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
    if (cand.loss_impl == "chunked" or cand.kernels == "liger") and recompute and lm_head(method):
        # the head's projection (2 h V per token) runs again in the backward: the recompute of
        # Cut Cross-Entropy (Wijmans et al. 2024), TRL's chunked_nll and memfit's Liger loss
        # (memfit.train.liger._LigerLogProbs.backward runs Liger's fused linear cross-entropy again)
        flops += 2 * arch.hidden_size * arch.vocab_size * tokens
    if cand.tiled_mlp and recompute:
        # TiledMLP recomputes each tile's MLP forward in its backward (ulysses_sp.TiledMLP.backward)
        mlp = (3 if arch.gated_mlp else 2) * arch.hidden_size * arch.intermediate_size
        flops += 2 * arch.num_layers * mlp * tokens
    return cand.grad_accum * flops


def uses_roofline(gpu: GPU) -> bool:
    """Whether the compute term is the per-operation roofline (memfit.estimate.time.roofline): on a
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
