"""The memory traffic of `kernels: liger` (memfit.train.liger) on a GPU's roofline
(memfit.estimate.time.roofline): Liger-Kernel's fused ops read their inputs and write their outputs
once, where transformers' eager modules run one kernel per element-wise op (roofline
`elementwise_bytes_per_token`, `rmsnorm_bytes`, `loss_bytes_per_token`). Counted per element from
liger-kernel 0.8.5's kernels (d = bytes per element of the training dtype):

- RMSNorm (ops/rms_norm.py `_rms_norm_forward_kernel`): reads X, writes Y (and one fp32 rstd per
  row): 2d; `_rms_norm_backward_kernel` reads dY and X, writes dX (into dY's storage, in_place):
  3d (the weight's per-program partial sums are per row, not per element).
- RoPE (ops/rope.py `_triton_rope`): q and k read and written in place (cos and sin read per row,
  shared by the heads): 2d forward, 2d backward, where transformers' rotate_half, two muls and an
  add move 10d (roofline).
- SwiGLU (ops/swiglu.py `_swiglu_forward_kernel`: reads a and b, writes c: 3d;
  `_swiglu_backward_kernel`: reads dc, a and b, writes da and db: 5d), where transformers' act
  and mul move 5d forward.
- The loss (ops/fused_linear_cross_entropy.py; memfit.train.liger._LigerLogProbs): per vocabulary
  element the forward writes a chunk's logits in the model dtype and the cross-entropy kernel
  (ops/cross_entropy.py `liger_cross_entropy_kernel`, without gradients) reads them once: 2d; the
  backward writes them again (the head's GEMM recomputed, as memfit's chunked loss does), the
  kernel reads them for the online max and sum and reads and writes them as their gradient (3d),
  and the product with the per-token upstream gradient reads and writes them (2d): 6d.

Hsu et al. 2024 ("Liger Kernel: Efficient Triton Kernels for LLM Training", arXiv:2410.10989) and
the project's README report, measured by them, "throughput by more than 20%" and "memory usage by
60%" (Llama-3-8B, batch 8, bf16, AdamW, gradient checkpointing, FSDP1 on 8 A100s); those are their
measurements, not used here: memfit prices the bytes and, with a calibration, measures the liger
engine itself (the calibrate rule patches it in as training does).
"""

from __future__ import annotations

from memfit.estimate.memory.method_terms import lm_head
from memfit.estimate.models.arch import ModelArch


def fused_bytes_per_token(arch: ModelArch, d: int, mlp_width: int, norm_bytes: int) -> tuple[float, float, float]:
    """(transformers' forward bytes of the ops Liger replaces, Liger's forward bytes, Liger's
    backward bytes) per token of one decoder layer (`norm_bytes`: transformers' RMSNorm per
    element, roofline.rmsnorm_bytes): its `norms_per_layer` RMSNorms of width h
    (Qwen3's and Gemma-3's per-head q/k norms stay transformers'), rotary over q and k, and a
    gated MLP's SwiGLU over `mlp_width` (a non-gated MLP keeps its activation)."""
    h, q, kv = arch.hidden_size, arch.num_attention_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    norms = arch.norms_per_layer * h
    swiglu = mlp_width if arch.gated_mlp else 0
    hf = norm_bytes * norms + 10 * d * (q + kv) + 5 * d * swiglu
    fwd = 2 * d * norms + 2 * d * (q + kv) + 3 * d * swiglu
    bwd = 3 * d * norms + 2 * d * (q + kv) + 5 * d * swiglu
    return float(hf), float(fwd), float(bwd)


def loss_bytes_per_token(arch: ModelArch, d: int) -> float:
    """Liger's fused linear cross-entropy per token, forward and backward (module docstring)."""
    return float(8 * d * arch.vocab_size)


def norm_bytes(d: int) -> float:
    """Liger's RMSNorm forward and backward per element (2d + 3d): the final norm's."""
    return 5.0 * d


def moved_per_token(
    arch: ModelArch,
    d: int,
    mlp_width: int,
    method: str,
    base: tuple[float, float, float, int],
    forwards: int,
    ref: float,
) -> float:
    """Bytes per token of a liger step's layers, final norm and loss (roofline.compute_seconds'
    `moved`): `base` = (transformers' element-wise forward bytes of a layer, LoRA's forward,
    LoRA's backward, transformers' RMSNorm bytes per element: roofline.rmsnorm_bytes); `forwards`
    the policy's forwards (2 with checkpointing), `ref` the forwards without gradient (a
    reference's: transformers' modules, its log-probs through Liger's loss)."""
    layer, lora_fwd, lora_bwd, rms = base
    hf, fwd, bwd = fused_bytes_per_token(arch, d, mlp_width, rms)
    moved = arch.num_layers * ((layer - hf + fwd + lora_fwd) * forwards + (layer + lora_fwd) * ref)
    moved += arch.num_layers * (2 * (layer - hf) + bwd + lora_bwd)
    moved += (norm_bytes(d) + rms * ref) * arch.hidden_size  # the final norm
    if lm_head(method):
        moved += loss_bytes_per_token(arch, d) + ref * 2 * d * arch.vocab_size
    return moved
