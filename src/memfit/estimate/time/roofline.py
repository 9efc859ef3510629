"""The compute seconds of a step on a GPU, from its operations (a roofline per operation).

A step of memfit's trainer runs transformers' eager modules, peft's LoRA layers and memfit's
own loss (memfit.train.losses, memfit.train.vocab_loss). Each operation takes the longer of its
FLOPs at the GPU's matrix rate and its bytes at the GPU's memory bandwidth (Williams, Waterman
and Patterson 2009, "Roofline: an insightful visual performance model", CACM 52(4)); the step
is their sum, one CUDA stream (the kernels of one micro step run one after another).

Three classes of operation:

- **GEMMs** (every nn.Linear in forward, its input gradient, its weight gradient when trained;
  the head; the routed experts' rows): 2 x rows x in x out FLOPs, reading the input and the
  weight and writing the output. At the model's shapes a GEMM runs below the GPU's dense peak:
  `Rates.gemm`, measured (`config/calibration/<gpu>.json`, tflops.gemm: the median of a
  Llama-3.1-8B step's 16 GEMM shapes) or assumed (the H100's measured fraction of its peak).
  A small micro batch makes a GEMM memory-bound (the weight is read for few rows).
- **Attention**: the fused kernels (sdpa, flash) at `Rates.attention` (measured causal SDPA),
  the backward 2.5 x the forward's FLOPs (torch.utils.flop_counter `sdpa_backward_flop_count`;
  Dao 2023, FlashAttention-2, sec. 3); eager attention materialises the scores: two batched
  GEMMs over the whole s x s matrix plus the traffic of scaling, masking, fp32 softmax and the
  cast back (transformers `eager_attention_forward`).
- **Memory-bound**: the element-wise operations of transformers' eager code, counted operation
  by operation from the modules memfit trains (below, per token): RMSNorm (an fp32 upcast,
  pow, mean, rsqrt, scale, cast back, weight), rotary (rotate_half's neg and cat, two muls, an
  add), SwiGLU's act and mul, the residual adds, the attention output's reshape, peft's LoRA
  (dropout, scaling, the add; its skinny A and B matmuls are GEMMs, bandwidth-bound at rank <<
  hidden), the loss over the vocabulary in fp32, and a QLoRA weight's NF4 dequantisation per use
  (bitsandbytes `matmul_4bit` dequantises the whole weight for a multi-row input). A layer's
  backward moves twice its forward's bytes (an element-wise op's backward reads the output
  gradient and the saved inputs and writes an input gradient per input: mul reads 4 and writes
  2 elements where its forward read 2 and wrote 1); LoRA's and eager attention's backward are
  counted op by op. tests/test_roofline.py checks these counts against the bytes of every
  kernel of the model's own traced step (memfit.estimate.trace.trace_flops, fake tensors).

What the model leaves out: kernel launch and Python dispatch time (a small micro batch on a
big GPU waits on the host), fused or compiled kernels of other frameworks (torch.compile,
Transformer Engine; Liger's, `kernels: liger`, are priced by their bytes in
memfit.estimate.time.liger_time), and the optimizer, communication and offload, which
`memfit.estimate.time.costs.step_time` adds as their own terms."""

from __future__ import annotations

from dataclasses import dataclass

from memfit.estimate.memory.method_terms import grad_seqs, lm_head, nograd_seqs
from memfit.estimate.models import calibration
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.models.catalog import GPU
from memfit.estimate.models.params import lora_targets, param_layout
from memfit.estimate.settings import Settings, dtype_bytes
from memfit.estimate.time import liger_time
from memfit.space import Candidate

# Measured on one H100 80GB HBM3 (SXM, 989.5 TFLOP/s dense bf16, config/gpus.yaml) on 2026-11-26,
# benchmarks/results/gpu_evidence_h100-80gb.json, stage context: the median of the 16 GEMMs of
# a Llama-3.1-8B step (x @ w.T at 1,024-8,192 rows; 628.9-781.9 TFLOP/s, median 735.15) and
# causal SDPA 32 x 8192 x 128 (615.2 TFLOP/s), as fractions of that peak. A GPU without its own
# calibration file is assumed to reach the same fractions of its own peak (stated per estimate).
H100_GEMM_FRACTION = 735.15 / 989.5
H100_ATTENTION_FRACTION = 615.2 / 989.5
# flash/SDPA backward FLOPs over the forward's (torch.utils.flop_counter sdpa_backward_flop_count)
ATTENTION_BACKWARD = 2.5


@dataclass(frozen=True)
class Rates:
    gemm: float  # FLOP/s a GEMM at the model's shapes reaches
    attention: float  # FLOP/s of the fused attention kernel
    memory: float  # bytes/s of device memory
    source: str  # measured or assumed, and from what


def rates(gpu: GPU, precision: str) -> Rates:
    """The GPU's rates: its calibration file's measured TFLOP/s where one exists (benchmarks/
    gpu_evidence.py --write-calibration), else the H100's measured fractions of this GPU's
    dense peak; memory at the file's measured `hbm_gbs` (a device-to-device copy), else the
    vendor's HBM bandwidth (config/gpus.yaml)."""
    peak = (gpu.tflops(precision) or gpu.tflops_fp32) * 1e12
    cal = calibration.for_gpu(gpu.name, gpu.compute_capability)
    memory, hbm = gpu.memory_bandwidth_gbs * 1e9, ""
    if cal.measured and cal.hbm_gbs:  # a device-to-device copy measured on this GPU
        memory, hbm = cal.hbm_gbs * 1e9, f", HBM {cal.hbm_gbs:,.0f} GB/s measured"
    gemm_tf = cal.tflops.get("gemm") or cal.tflops.get("matmul")
    if cal.measured and gemm_tf and precision != "fp32":  # the calibration measures bf16 kernels
        attention = cal.tflops.get("attention", gemm_tf)
        return Rates(gemm_tf * 1e12, attention * 1e12, memory, f"GEMM and attention rates {cal.label()}{hbm}")
    return Rates(
        H100_GEMM_FRACTION * peak,
        H100_ATTENTION_FRACTION * peak,
        memory,
        f"GEMM {H100_GEMM_FRACTION:.0%} and attention {H100_ATTENTION_FRACTION:.0%} of the "
        f"{precision} peak (fractions measured on an H100, assumed here){hbm}",
    )


def _gemm(rows: float, n_in: int, n_out: int, d: int, r: Rates) -> float:
    """One pass of a linear over `rows` tokens: the longer of 2 x rows x in x out FLOPs and the
    bytes of the input, the weight and the output. Its input gradient (dY @ W) and weight
    gradient (X^T @ dY) move the same three tensors' bytes for the same FLOPs."""
    moved = d * (rows * (n_in + n_out) + n_in * n_out)
    return max(2 * rows * n_in * n_out / r.gemm, moved / r.memory)


gemm_seconds = _gemm  # one linear's pass, for runtime_costs' per-module ZeRO-3 overlap


def _linears_seconds(shapes, rows: float, cand: Candidate, d: int, r: Rates, trained: bool, forwards: int) -> float:
    """A layer's linears: `forwards` forwards (2 with recompute), the input gradient, the weight
    gradient when `trained`. QLoRA's NF4 weight (0.5 byte per element; bitsandbytes
    `dequantize_4bit` writes it out in the compute dtype) is dequantised before each use."""
    passes = forwards + 1 + (1 if trained else 0)
    deq = (0.5 + d) / r.memory if cand.finetune == "qlora" else 0.0
    return sum(
        passes * _gemm(rows, n_in, n_out, d, r) + (forwards + 1) * deq * n_in * n_out for _, n_in, n_out in shapes
    )


def rmsnorm_bytes(d: int) -> int:
    """LlamaRMSNorm per element: `.to(float32)` (d + 4; no copy in fp32), `pow(2)` (4 + 4),
    `mean` (4), `* rsqrt` (4 + 4), `.to(input_dtype)` (4 + d; none in fp32), `weight *` (d + d)."""
    upcast = 0 if d == 4 else (d + 4) + (4 + d)
    return upcast + 8 + 4 + 8 + 2 * d


def elementwise_bytes_per_token(arch: ModelArch, d: int, mlp_width: int) -> float:
    """Bytes one token moves through a decoder layer's element-wise ops in a forward, from the
    eager code memfit trains (transformers' Llama family, modeling_llama.py; d = bytes per
    element of the training dtype, fp32 intermediates 4):

    - LlamaRMSNorm (`rmsnorm_bytes`): `norms_per_layer` of width h, plus Qwen3/Gemma-3's
      per-head q and k norms over the q + kv widths;
    - rotary on q and k (`apply_rotary_pos_emb`): rotate_half's neg (d/2 + d/2) and cat (d + d),
      q * cos (d + d), rotate_half(q) * sin (d + d), the add (2d + d): 10 d per element;
    - the attention output's transpose + reshape copy (d + d per element of q's width);
    - two residual adds (2d + d per element of h);
    - the MLP: SwiGLU `act_fn(gate)` (d + d) and `* up` (2d + d) per intermediate element; a
      non-gated MLP only the activation (`mlp_width`: an MoE layer's top-k experts' widths
      plus its shared expert)."""
    h, q, kv = arch.hidden_size, arch.num_attention_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    norm = rmsnorm_bytes(d)
    norms = arch.norms_per_layer * h + (q + kv if arch.qk_norm else 0)
    mlp = 5 * d if arch.gated_mlp else 2 * d
    return norm * norms + 10 * d * (q + kv) + 2 * d * q + 2 * 3 * d * h + mlp * mlp_width


def lora_bytes_per_token(arch: ModelArch, cand: Candidate, settings: Settings, d: int) -> tuple[float, float]:
    """(forward, backward) element-wise bytes per token of peft's LoRA layers (peft/tuners/lora/
    layer.py Linear.forward: `result + lora_B(lora_A(dropout(x))) * scaling`) over the adapted
    linears; the skinny A and B matmuls are GEMMs (`compute_seconds`). Forward per input element:
    with dropout, the dropout (read d, write d and a 1-byte mask); per output element `* scaling`
    (d + d) and the add (2d + d). Backward: the scaling's gradient (d + d per output), the
    dropout's mask multiply (2d + 1 per input), and the input's gradient accumulated over the
    base and the adapter paths (2d + d per input)."""
    if cand.finetune == "full":
        return 0.0, 0.0
    drop = 2 * d + 1 if settings.lora_alpha_dropout else 0
    shapes = lora_targets(arch, settings)
    ins, outs = sum(i for _, i, _ in shapes), sum(o for _, _, o in shapes)
    return float(drop * ins + 5 * d * outs), float(drop * ins + 2 * d * outs + 3 * d * ins)


def _lora_gemm_seconds(
    arch: ModelArch, cand: Candidate, settings: Settings, rows: float, d: int, r: Rates, forwards: int
) -> float:
    """LoRA's A (in -> rank) and B (rank -> out) per adapted linear: the forwards, the input
    gradients and the weight gradients, each bandwidth-bound at rank << width."""
    if cand.finetune == "full":
        return 0.0
    k = cand.lora_rank
    one = sum(_gemm(rows, i, k, d, r) + _gemm(rows, k, o, d, r) for _, i, o in lora_targets(arch, settings))
    return (forwards + 2) * one


def loss_bytes_per_token(arch: ModelArch, cand: Candidate, d: int) -> float:
    """memfit's loss over the vocabulary V per token (memfit.train.losses / vocab_loss), fp32:
    full: the shifted logits' `.float()` copy (d + 4; a view in fp32), log_softmax (4 + 4),
    backward: the gather's scatter (4), log_softmax's (4 + 4 + 4), the cast back (4 + d), the
    shift's zero-filled gradient (d + d + d). Chunked: the forward's upcast (d + 4) and
    logsumexp (4), the backward's recomputed upcast (d + 4), exp and scale in place (4 + 4,
    4 + 4), the cast for the gradient GEMMs (4 + d)."""
    up = 0 if d == 4 else d + 4
    per_vocab = (up + 8) + 4 + 12 + (0 if d == 4 else 4 + d) + 3 * d
    if cand.loss_impl == "chunked":
        per_vocab = 2 * up + 4 + 16 + (4 + d)
    return float(per_vocab * arch.vocab_size)


def _attention_seconds(arch: ModelArch, cand: Candidate, seqs: int, d: int, r: Rates) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's attention core. Causal FLOPs as `step_flops`
    counts them (2 x tokens x attended positions x heads x head_dim; under Ulysses a rank holds
    seq_len / SP tokens and attends over all seq_len x SP positions for heads / SP: the same)."""
    tokens, attended = seqs * cand.seq_len, cand.seq_len * cand.sequence_parallel
    heads = arch.num_attention_heads
    if cand.attn != "eager":
        fwd = 2 * tokens * attended * heads * arch.head_dim / r.attention
        return fwd, ATTENTION_BACKWARD * fwd
    # eager_attention_forward: the whole s x s score matrix per head. QK^T and PV (2 x 2 x
    # elements x head_dim FLOPs); per score element: the matmul's write (d), `* scaling` (d + d),
    # `+ causal_mask` (d + d + d), softmax in fp32 (d + 4), `.to(query.dtype)` (4 + d), PV's read (d)
    # the backward: the two matmuls' gradients (twice their FLOPs) and the same traffic once more
    # (softmax's and the casts' gradients; the mask takes none)
    elements = seqs * heads * cand.seq_len * attended
    matmuls, traffic = 4 * elements * arch.head_dim / r.gemm, elements * (9 * d + 8) / r.memory
    return matmuls + traffic, 2 * matmuls + traffic


def nograd_passes(cand: Candidate, method: str) -> int | float:
    """The forwards without gradient as multiples of the policy's forward with gradient: DPO's
    reference runs the same chosen + rejected batch (1); KTO's policy on the KL batch and its
    reference on the rows and the KL batch (3 forwards of the rows' size, 1 with precomputed
    reference log-probs)."""
    ng, g = nograd_seqs(cand, method), grad_seqs(cand, method)
    return ng // g if ng % g == 0 else ng / g


def compute_seconds(arch: ModelArch, cand: Candidate, gpu: GPU, method: str, settings: Settings) -> dict[str, float]:
    """Seconds of the step's computation on one rank by class: `gemm` (every linear, the head,
    the experts), `attention` (the attention core) and `memory` (the element-wise operations,
    LoRA's adapters, the loss, the embedding, QLoRA's dequantisation), each operation at its
    roofline (module docstring). Passes: the forward, its recompute under checkpointing, the
    backward, the forwards without gradient (a reference's, `ref: model` or `adapter`, and KTO's
    KL batch: `forward_passes`); x gradient accumulation. A reward model's head is its h x 1
    score: no vocabulary loss."""
    r, d = rates(gpu, cand.precision), dtype_bytes(cand.precision)
    if arch.generic:
        return _traced_seconds(arch, cand, method, settings, r)
    seqs = grad_seqs(cand, method)
    tokens = seqs * cand.seq_len
    trained = cand.finetune == "full"
    ref = nograd_passes(cand, method)
    forwards = 1 + (1 if cand.grad_ckpt else 0)
    layout = param_layout(arch)
    h, V = arch.hidden_size, arch.vocab_size
    head_out = V if lm_head(method) else 1  # a reward model's score: Linear(h, 1)

    gemm = 0.0
    for layer in range(arch.num_layers):
        shapes = layout.layer_linear_shapes(arch, layer)
        gemm += _linears_seconds(shapes, tokens, cand, d, r, trained, forwards + ref)
        if cand.tiled_mlp:  # TiledMLP recomputes each tile's MLP forward in its backward
            mlp = [s for s in shapes if s[0] in arch.mlp_linear_shapes()]
            gemm += _linears_seconds(mlp, tokens, cand, d, r, False, 0)
    if arch.is_moe:  # routed experts: top-k rows spread over the experts; the router
        rows = tokens * arch.num_experts_per_tok / arch.num_experts
        experts = arch.num_experts * sum(_gemm(rows, i, o, d, r) for i, o in arch.expert_linear_shapes().values())
        router = _gemm(tokens, *arch.router_shape(), d, r)
        gemm += len(arch.moe_layers()) * (experts + router) * (forwards + ref + 1 + (1 if trained else 0))
    gemm += arch.num_layers * _lora_gemm_seconds(arch, cand, settings, tokens, d, r, forwards + ref)
    head = _gemm(tokens, h, head_out, d, r)
    recomputed_head = (cand.loss_impl == "chunked" or cand.kernels == "liger") and lm_head(method)
    head_forwards = 1 + (1 if recomputed_head else 0) + ref
    gemm += head * (head_forwards + 1 + (1 if trained else 0))

    fwd, bwd = _attention_seconds(arch, cand, seqs, d, r)
    attention = arch.num_layers * ((forwards + ref) * fwd + bwd)

    mlp_width = arch.intermediate_size
    if arch.is_moe:
        mlp_width = arch.moe_intermediate_size * arch.num_experts_per_tok + arch.shared_expert_intermediate_size
    base = elementwise_bytes_per_token(arch, d, mlp_width)
    lora_fwd, lora_bwd = lora_bytes_per_token(arch, cand, settings, d)
    if cand.kernels == "liger":  # the policy's norms, rotary, SwiGLU and loss as Liger's fused kernels
        moved = liger_time.moved_per_token(
            arch, d, mlp_width, method, (base, lora_fwd, lora_bwd, rmsnorm_bytes(d)), forwards, ref
        )
    else:
        moved = arch.num_layers * ((base + lora_fwd) * (forwards + ref) + 2 * base + lora_bwd)
        moved += rmsnorm_bytes(d) * h * (1 + ref + 2)  # the final norm (not recomputed)
        if lm_head(method):
            moved += loss_bytes_per_token(arch, cand, d) + ref * (d + 4 + 8) * V
    moved += 2 * d * h * (1 + ref)  # the embedding lookup (read a row, write it)
    memory = tokens * moved / r.memory
    if trained:  # embedding_dense_backward: the V x h gradient zeroed, the tokens' rows added
        memory += d * (V * h + 3 * tokens * h) / r.memory
    return {k: cand.grad_accum * v for k, v in (("gemm", gemm), ("attention", attention), ("memory", memory))}


def _traced_seconds(arch: ModelArch, cand: Candidate, method: str, settings: Settings, r: Rates) -> dict[str, float]:
    """A generic card (no formulas: memfit.estimate.models.generic) from its traced step, the same
    trace its activations come from (memfit.estimate.trace.traced): the matmuls' FLOPs at the GEMM
    rate, the attention kernels' at the attention rate, every other kernel's bytes at the
    bandwidth (trace_flops `_op_bytes`), so linear attention, sliding windows, MLA and routing
    cost what the model's code runs. The trace counts attention FLOPs over the whole s x s
    square (as torch's `sdpa_flop_count` does: trace_flops `_attention_flops`); the kernel of a causal model skips the masked half, and
    the measured rate counts only the computed half: halved here. The matmuls are taken as
    compute-bound (the trace keeps no per-matmul shapes)."""
    from memfit.estimate.trace.traced import traced_run

    traced = traced_run(arch, cand, settings)
    seqs, L = grad_seqs(cand, method), arch.num_layers
    names = ("flops", "attn_flops", "mem_bytes")
    flops, attn, moved = (traced.at(n, L, seqs) for n in names)
    nograd = nograd_seqs(cand, method)
    if nograd:  # the forwards without gradient: a reference's, KTO's KL batch
        flops, attn, moved = (
            x + traced.at(f"fwd_{n}", L, nograd) for x, n in zip((flops, attn, moved), names, strict=True)
        )
    if (cand.loss_impl == "chunked" or cand.kernels == "liger") and lm_head(
        method
    ):  # the head's matmul again in the backward (costs.step_flops)
        flops += 2 * arch.hidden_size * arch.vocab_size * seqs * cand.seq_len
    terms = {"gemm": (flops - attn) / r.gemm, "attention": attn / 2 / r.attention, "memory": moved / r.memory}
    return {k: cand.grad_accum * v for k, v in terms.items()}
