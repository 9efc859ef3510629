"""Activation memory of `kernels: liger` (memfit.train.liger): what Liger-Kernel's fused ops save for
the backward where transformers' modules save more, read from liger-kernel 0.8.5's source (the
version envs/memfit-gpu.yaml and the `liger` extra pin), as differences to the terms
memfit.estimate.memory.activation_memory counts for transformers' decoder layer (the formulas, and
the traced run, which runs the stock transformers layer: `adjust` prices the difference on either).

- RMSNorm (liger_kernel/ops/rms_norm.py `LigerRMSNormFunction.forward`: `ctx.save_for_backward(X,
  W, RSTD)`, RSTD fp32 in the llama casting mode): the input X in the model dtype and the fp32
  rstd per row. transformers' LlamaRMSNorm saves the fp32 upcast of the input (`pow(2)`), rstd,
  and, when the weight trains, the normalised y (`ActivationMemory._layer_saved`,
  `MicroStep.rmsnorm`). Per norm whose input needs a gradient Liger saves (4 - d) t h fewer
  bytes, plus d t h with a trained weight; the norm's output, saved by the next linear, is the same.
- SwiGLU (ops/swiglu.py `LigerSiLUMulFunction.forward`: `ctx.save_for_backward(a, b)`, silu(a)
  recomputed in `swiglu_backward`): gate and up, not silu(gate): d t i fewer bytes per dense gated
  MLP. Its backward writes the gradients of a and b into their saved storage
  (`_swiglu_backward_kernel`; `swiglu_backward` returns `a`, `b`), but the MLP's backward transients
  are kept as transformers': the peak comes before it, at down_proj's input gradient (a LoRA
  down_proj sums its base and adapter paths' d t i gradients there; measured on the CPU, where
  taking d t i off undercounted the LoRA step's peak by 4.1%).
- RoPE (ops/rope.py `LigerRopeFunction.forward`: `ctx.save_for_backward(cos, sin)`, q and k
  rotated in place in their projections' storage): transformers' `apply_rotary_pos_emb` saves
  cos and sin too (q * cos, rotate_half(q) * sin; the rotated q and k are the attention's
  saved inputs either way): no difference.
- The loss (ops/fused_linear_cross_entropy.py `fused_linear_cross_entropy_forward`, called by
  memfit.train.liger._LigerLogProbs with reduction "none"): no [tokens, vocab] logits saved; memfit
  saves the scored hidden rows (d h per token) and int64 targets, and the scattered fp32 log-probs
  and bool mask, as its chunked loss does (`logits.chunked_loss_terms`) less the log-sum-exp; the
  final norm's output, which a trained head's nn.Linear saves, is not saved (measured: the full
  fine-tune's saved bytes were d t h over the estimate without this term, the LoRA one's not).
  The backward runs the function again with gradients: `grad_input` (zeros_like the hidden rows,
  d t h), the head's gradient (zeros_like the weight, d V h, when it trains), per chunk of c
  tokens the logits in the model dtype (d c V), whose gradient the kernel writes in place, and
  their product with the upstream per-token gradient (`token_grad_output`, a second d c V), with
  c = next_pow2(ceil(t / ceil(V / h))) capped at t (`inc_factor`, `chunk_size`). In fp32 (and on
  any device but CUDA sm80+ in bf16) the head's gradient is summed through a parameter-sized
  fp32 temporary (`grad_weight += torch.mm(...).float()`, the "legacy fallback").

What is not priced: Qwen3's per-head q/k norms and Gemma's post-norms stay transformers' (an
upper bound), mixture-of-experts blocks keep transformers' terms (their norms take Liger's), and
the RMSNorm backward's in-place dX (in_place=True) is not taken off the layer's transients.
"""

from __future__ import annotations

from memfit.estimate.memory.micro_step import MicroStep
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.settings import dtype_bytes
from memfit.space import Candidate


def norm_saving(step: MicroStep) -> int:
    """Bytes one RMSNorm whose input needs a gradient saves less under Liger (module docstring)."""
    d, t, h = step.dtype, step.tokens, step.arch.hidden_size
    return (4 - d) * t * h + (d * t * h if step.full else 0)


def swiglu_saving(step: MicroStep, moe: bool) -> int:
    """Bytes a dense gated MLP saves less under Liger: silu(gate) (0 for a tiled or MoE MLP)."""
    if moe or step.tile_rows or not step.arch.gated_mlp:
        return 0
    return step.dtype * step.tokens * step.arch.intermediate_size


def layer_saving(step: MicroStep, moe: bool) -> int:
    """Bytes one decoder layer saves less under Liger: its two norms and its SwiGLU."""
    return 2 * norm_saving(step) + swiglu_saving(step, moe)


def adjust(acts, step: MicroStep, cand: Candidate, n_moe: int) -> None:
    """Take Liger's savings off `acts` (memfit.estimate.memory.activation_memory.Activations, from the
    formulas or the traced run of transformers' layer) in place; the head's terms are `loss_terms`'."""
    L = step.arch.num_layers
    moe = n_moe == L
    per = layer_saving(step, moe)
    norm = norm_saving(step)
    all_layers = n_moe * layer_saving(step, True) + (L - n_moe) * layer_saving(step, False)
    if not step.full:  # LoRA: layer 0's first norm sees the frozen embedding and saves nothing either way
        all_layers -= norm
    acts.per_layer -= per
    # the final norm: Liger's, and its output is not saved by a trained head (memfit.train.liger runs
    # the head inside Liger's loss, which saves the scored rows' copy, `loss_terms`)
    final = norm + (step.dtype * step.tokens * step.arch.hidden_size if step.full else 0)
    acts.final -= final
    if cand.grad_ckpt:  # the checkpoint keeps the layer inputs; the recomputed layer saves less
        acts.saved -= final
        # ... and Liger's first norm saves the checkpointed input itself, not a copy of it
        acts.recompute -= per + (step.dtype * step.tokens * step.arch.hidden_size if step.dtype < 4 else 0)
    else:
        acts.saved -= all_layers + final
        acts.kept_per_layer -= per
        acts.forward -= all_layers - per  # the layers below the last one
    mlp = swiglu_saving(step, moe)
    acts.attn_bwd += mlp + norm  # freed at the MLP's backward: less of it is there to free
    acts.layer_bwd = max(acts.mlp_bwd, acts.attn_bwd)


def chunk_rows(arch: ModelArch, tokens: int) -> int:
    """Tokens per chunk of Liger's fused linear cross-entropy (fused_linear_cross_entropy.py:
    inc_factor = cdiv(V, h), chunk_size = min(next_power_of_2(cdiv(BT, inc_factor)), BT))."""
    inc = -(-arch.vocab_size // arch.hidden_size)
    rows = -(-tokens // inc)
    return min(1 << (rows - 1).bit_length(), tokens)


def loss_terms(arch: ModelArch, cand: Candidate, tokens: int, full: bool) -> tuple[int, int]:
    """(saved, transient at the loss's backward) bytes of memfit.train.liger's log-probs, every
    token scored (the worst case), as the module docstring derives them."""
    d, h, V, t = dtype_bytes(cand.precision), arch.hidden_size, arch.vocab_size, tokens
    saved = t * (d * h + 8) + t * (4 + 1)
    c = chunk_rows(arch, t)
    head_grad = V * h * d if full else 0
    fp32_sum = V * h * 4 if full and d == 4 else 0  # the legacy fallback's parameter-sized temporary
    upstream = 4 * t  # -grad_out.float(): the per-token upstream gradient
    return saved, 2 * d * c * V + t * d * h + head_grad + fp32_sum + upstream


def nograd_loss(arch: ModelArch, cand: Candidate, tokens: int) -> int:
    """A forward without gradient through Liger's loss (a reference's log-probs): grad_input is
    allocated even then (zeros_like the hidden rows), the fp32 per-token losses and one chunk's
    logits in the model dtype."""
    d = dtype_bytes(cand.precision)
    return d * tokens * arch.hidden_size + 4 * tokens + d * chunk_rows(arch, tokens) * arch.vocab_size
