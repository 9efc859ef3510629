"""Activation memory of one micro step per rank: what autograd saves, the loss's logit terms and
the transients of the forward and of one layer's backward. From formulas (`activations`) or
from a traced run of the model's own code (`traced_activations`, memfit.estimate.trace.trace).

The formulas count what autograd saves in transformers' decoder layer (modeling_llama.py,
modeling_qwen2.py), tensor by tensor; the structure of Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models", sec. 4.1: sbh(34 + 5as/h)), re-derived
for RMSNorm + SwiGLU + GQA + rotary and for the attention kernels: eager attention keeps the
s x s probabilities (fp32 softmax); SDPA and FlashAttention keep only the output and the
log-sum-exp (Dao et al. 2022, FlashAttention, sec. 3.1). Checked against real training steps
measured with `memory.AllocationTracker` (tests/test_estimate_groundtruth.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from memfit.estimate.memory import liger_terms
from memfit.estimate.memory.logits import chunk_tokens, chunked_loss_terms
from memfit.estimate.memory.method_terms import forward_seqs, lm_head, nograd_forward_seqs
from memfit.estimate.memory.micro_step import MicroStep, linear_names, micro_step
from memfit.estimate.memory.padding_mask import _padding_mask_extra, _padding_mask_once
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.models.params import lora_targets
from memfit.estimate.settings import Settings
from memfit.space import Candidate


@dataclass
class Activations:
    """Activation and logit bytes of one micro step on one rank."""

    saved: int = 0  # everything autograd keeps after the forward (incl. the logits terms)
    per_layer: int = 0  # one decoder layer's saved tensors (recomputed per layer with checkpointing)
    logits_saved: int = 0  # logits + fp32 log-softmax kept for the backward
    logits_bwd_extra: int = 0  # the loss backward's two fp32 [tokens, vocab] gradients
    layer_bwd: int = 0  # transient gradients inside one layer's backward
    mlp_bwd: int = 0  # ... at the MLP's backward (runs first)
    attn_bwd: int = 0  # ... at the attention's backward (MLP tensors already freed)
    final: int = 0  # the final norm's saved tensors (freed before the layers' backward)
    kept_per_layer: int = 0  # what stays saved per layer until its backward
    recompute: int = 0  # checkpointing: one layer's recomputed tensors during its backward
    attention_scores: int = 0  # eager only: the s x s probabilities of all layers (for the breakdown)
    ref_forward: int = 0  # DPO reference forward transient (no_grad)
    forward: int = 0  # the policy forward's peak (last layer's attention call)
    # another trainer's logits handling (Settings.logits_handling, `held_logits`); 0 for memfit's
    loss_forward_extra: int = 0  # the loss forward's [t, V] tensors beyond the loss backward's
    held_logits: int = 0  # logits the caller keeps referenced through backward and optimizer step
    dequant: int = 0  # QLoRA: one linear's weight dequantized to 16 bits (in forward/backward)
    # traced, generic cards: the bottom layer's backward peak, activation side (0: built from the
    # top layer's terms, as for the hand-written cards)
    bottom_bwd: int = 0


def _eager_probabilities(step: MicroStep) -> int:
    """One layer's fp32 softmax output (and its 16-bit copy in 16-bit training)."""
    d, b, s, nh = step.dtype, step.seqs, step.seq_len, step.arch.num_attention_heads
    return 4 * b * nh * s * s + (d * b * nh * s * s if d < 4 else 0)


def _moe_routing_weight_bytes(arch: ModelArch, dtype: int) -> int:
    """Bytes per element of the routing weights the experts multiply by: Mixtral's router keeps
    them fp32 (modeling_mixtral.MixtralTopKRouter: softmax(router_logits.float())), Qwen2-MoE and
    Qwen3-MoE cast them back to the model dtype (Qwen2MoeTopKRouter: `.to(router_logits.dtype)`)."""
    return 4 if arch.model_type == "mixtral" else dtype


def _moe_router_topk_norm(arch: ModelArch) -> bool:
    """Whether the router renormalises its top-k weights (an in-place division that saves them):
    always in Mixtral, `norm_topk_prob` in Qwen-MoE (Qwen1.5/Qwen2-MoE: false, Qwen3-MoE: true)."""
    return arch.model_type in ("mixtral", "qwen3_moe")


def moe_mlp_saved(step: MicroStep) -> int:
    """What autograd saves for one MoE block (the MLP of an MoE layer) beyond its input, the
    second norm's output, with transformers' default experts implementation "grouped_mm"
    (PreTrainedModel.get_correct_experts_implementation; integrations/moe.py
    grouped_mm_experts_forward) and the routers of modeling_mixtral / modeling_qwen2_moe /
    modeling_qwen3_moe. t tokens, k = num_experts_per_tok, S = t*k token-expert pairs, E experts,
    I_e = moe_intermediate_size:
      router:   softmax of fp32 logits keeps its fp32 output 4tE; topk keeps int64 indices 8tk;
                the top-k renormalisation (in-place div) keeps the values and their sum 4tk + 4t
      experts:  each token's hidden copied once per selected expert (hidden_states[perm // k],
                saved by the grouped matmul when the experts train) dSh; gate_up output (kept by
                silu and the product: gate and up are its views) 2dSI_e; silu(gate) dSI_e; the
                product (down_proj's input, saved when the experts train) dSI_e; the expert
                output dSh and the routing weights wS (w: fp32 in Mixtral, d in Qwen), both
                kept by their product; three int64 permutations (perm // k, perm, inv_perm) 24S
      shared:   a dense gated MLP of width shared_expert_intermediate_size (Qwen2-MoE), and its
                sigmoid gate: sigmoid output dt and the gated shared output dth
    LoRA/QLoRA with frozen experts (Qwen2-MoE, or explicit targets): the copied hidden and
    down_proj's input are not saved. With peft's expert adapters (`states.lora_adapts_experts`:
    Mixtral, Qwen3-MoE with "all-linear") they are, and so are the adapted weights themselves:
    ParamWrapper parametrizes each 3D parameter as W + s * lhs @ rhs (peft/tuners/lora/layer.py
    _LoraFactorsProxy: one baddbmm), a new (E, out, in) tensor per layer that the grouped matmul
    keeps for its input gradient: d * E * 3 * h * I_e per MoE layer, plus the router's (E, h).
    Checked against a CPU measurement with memory.AllocationTracker (tests/test_estimate_moe.py).
    """
    arch, d, t = step.arch, step.dtype, step.tokens
    h, E, k, ie = arch.hidden_size, arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size
    S = t * k
    router = 4 * t * E + 8 * t * k
    if _moe_router_topk_norm(arch):
        router += 4 * t * k + 4 * t
    experts = 3 * d * S * ie + d * S * h + _moe_routing_weight_bytes(arch, d) * S + 3 * 8 * S
    if step.full or step.expert_adapters:
        experts += d * S * h + d * S * ie  # copied hidden (grouped_mm input), down_proj's input
    if step.expert_adapters:  # the parametrized W + delta of the experts and of the router
        experts += d * E * arch.expert_params() + d * E * h
    shared = 0
    if arch.shared_expert_intermediate_size:
        shared = _dense_mlp_saved(step, arch.shared_expert_intermediate_size)
        if arch.shared_expert_gate:
            shared += d * t + d * t * h
    return router + experts + shared


def _dense_mlp_saved(step: MicroStep, width: int) -> int:
    """A dense (Swi)GLU MLP's saved tensors beyond its input: gate, silu(gate), up (3dti) and
    the product, down_proj's input, when down_proj trains or is adapted (non-gated: 1 + 1)."""
    d, t = step.dtype, step.tokens
    down_input = d * t * width if step.trainable(linear_names(step.arch)["down"]) else 0
    return (3 if step.arch.gated_mlp else 1) * d * t * width + down_input


def _layer_saved(cand: Candidate, settings: Settings, step: MicroStep, moe: bool = False) -> int:
    """What autograd saves for one decoder layer (modeling_llama.py LlamaRMSNorm, LlamaAttention,
    LlamaMLP):
      attention:  rotated q dt*qd, rotated k and v dt*kvd each, output dt*qd;
                  sdpa/flash: log-sum-exp 4*b*heads*s (FlashAttention-2 softmax_lse);
                  eager: fp32 softmax 4*b*heads*s^2 (+ its 16-bit copy), repeat_kv'd k and v
      SwiGLU:     gate, silu(gate), up, silu(gate)*up: 4dti (non-gated: 2dti)
    LoRA: frozen weights keep nothing for their own gradient, so the normalised x of the norms
    and the inputs of frozen, non-adapted linears are not saved; each adapter keeps its
    r-wide hidden dtr."""
    arch, d, b, s, t = step.arch, step.dtype, step.seqs, step.seq_len, step.tokens
    i = arch.intermediate_size
    nh, nkv = arch.num_attention_heads, arch.num_kv_heads
    qd, kvd = nh * arch.head_dim, nkv * arch.head_dim
    names = linear_names(arch)
    layer = step.rmsnorm(any(step.trainable(n) for n in names["qkv"]))
    layer += d * t * qd + 2 * d * t * kvd  # rotated q, k; v
    if arch.qk_norm:  # Qwen3/Gemma-3 per-head RMSNorm on q and k before rotary
        layer += 4 * t * (qd + kvd) + (d * t * (qd + kvd) if step.full else 0) + 4 * b * s * (nh + nkv)
    if cand.attn == "eager":
        layer += _eager_probabilities(step)
        if nkv < nh:
            layer += 2 * d * t * qd  # repeat_kv copies of k and v (saved by the two matmuls)
        if step.trainable(names["o"]):
            layer += d * t * qd  # transpose(1,2).contiguous() output saved by o_proj
    else:
        layer += d * t * qd + 4 * b * nh * s  # kernel output (also o_proj's input) + lse
        if cand.sequence_parallel > 1:
            # Ulysses: o_proj's input is the output all-to-all's result, a tensor besides the kernel's
            # output (ulysses_sp.py _partition_global_sequence; measured: +d t qd per layer, demo model)
            layer += d * t * qd
        layer += _padding_mask_extra(cand, settings, step)
        if step.packed_seqs and cand.attn == "sdpa":
            # padding_free: memfit's per-sequence sdpa (memfit.train.varlen_attention) gathers the
            # kernel's [sequences, heads, longest, d] output back into the row's order, a tensor of
            # its own that o_proj saves where it trains; and the two gathers keep their int64
            # indices (the block's reads and the tokens' slots: t each in the probes' worst case).
            # Measured with saved-tensor hooks on the groundtruth Llama: +d t qd + 16 t a layer
            # (tests/test_padding_free_search.py)
            layer += (d * t * qd if step.trainable(names["o"]) else 0) + 16 * t
    if moe:  # residual + second norm (its output saved by the trained router/experts/shared)
        trained = step.full or step.expert_adapters
        layer += step.rmsnorm(trained or any(step.trainable(n) for n in names["up"]))
        layer += moe_mlp_saved(step)
    elif step.tile_rows:  # TiledMLP saves its input alone (ulysses_sp.TiledMLP.forward: save_for_backward(x))
        layer += step.rmsnorm(True)
    else:
        layer += step.rmsnorm(any(step.trainable(n) for n in names["up"]))  # residual + 2nd norm
        down_input = d * t * i if step.trainable(names["down"]) else 0
        layer += (3 if arch.gated_mlp else 1) * d * t * i + down_input
    extra_norms = getattr(arch, "norms_per_layer", 2) - 2  # Gemma-3 post-norms
    layer += extra_norms * step.rmsnorm(False)
    if not step.full:
        layer += sum(d * t * cand.lora_rank for _ in step.targets)
        if settings.lora_alpha_dropout:
            layer += sum(d * t * fan_in + t * fan_in for _, fan_in, _ in lora_targets(arch, settings))
    return layer


def _moe_forward_transient(step: MicroStep) -> int:
    """The MoE block's forward transients on top of what it saves (grouped_mm_experts_forward):
    the weighted expert outputs (S, h) and their reordered copy, in the routing weights' dtype
    (fp32 in Mixtral: bf16 outputs times fp32 weights promote)."""
    arch = step.arch
    w = max(_moe_routing_weight_bytes(arch, step.dtype), step.dtype)
    return 2 * w * step.tokens * arch.num_experts_per_tok * arch.hidden_size


def _layer_backward_transients(cand: Candidate, step: MicroStep, moe: bool = False) -> tuple[int, int]:
    """Transient gradients inside a layer's backward, on top of the layer's saved tensors:
    (at the MLP's backward, at the attention's backward). MoE layers: the expert block's
    backward peaks at gate_up_proj's grouped matmul backward, holding the gradient of the
    gate_up output (2dSI_e) and of the copied hidden (dSh) next to dth; the fp32 gradient of the
    weighted outputs (4Sh, Mixtral) is freed by then (measured: tests/test_estimate_moe.py)."""
    arch, d, b, s, t = step.arch, step.dtype, step.seqs, step.seq_len, step.tokens
    h, i = arch.hidden_size, arch.intermediate_size
    nh, nkv = arch.num_attention_heads, arch.num_kv_heads
    qd, kvd = nh * arch.head_dim, nkv * arch.head_dim
    # MLP backward (runs first): the gradient of silu(gate)*up and of one factor (2dti) and the
    # gradient of the hidden state (dth).
    mlp_extra = 2 * d * t * i + d * t * h
    if moe:
        S = t * arch.num_experts_per_tok
        mlp_extra = 2 * d * S * arch.moe_intermediate_size + d * S * h + d * t * h
        if arch.shared_expert_intermediate_size:
            mlp_extra += 2 * d * t * arch.shared_expert_intermediate_size
    # attention backward (after the MLP's saved tensors and the second norm's are freed):
    # eager: the gradients of the probabilities and of the scores (s x s, the latter fp32);
    # sdpa/flash: the gradients of q, k and v.
    mlp_saved = (4 if arch.gated_mlp else 2) * d * t * i + step.rmsnorm(True)
    if step.tile_rows and not moe:
        # TiledMLP.backward: the incoming gradient (dth) and the input's gradient buffer (x_grad,
        # zeros_like: dth); per tile the recomputed intermediates (4dri: gate, up, act(gate), their
        # product), their gradients (3dri: the product's, then act(gate)'s and up's), the tile's
        # output and its input gradient before it is added into x_grad (2drh). Rows padded to a
        # multiple of the tiles (memfit.train.long_context) add the slice's zero-filled gradient
        # (dth). Nothing of the MLP was saved in the forward. Measured on 2 CPU ranks (demo model,
        # probes of SFT and DPO, ZeRO-2/3, with and without checkpointing and SP=2): -3.1% to +0.4%
        # (benchmarks/bench_long_context.py's 10 tiled probes: -1.1% to -0.5%).
        r = step.tile_rows
        padded = t % step.mlp_tiles != 0
        mlp_extra = (2 + padded) * d * t * h + 7 * d * r * i + 2 * d * r * h
        mlp_saved = step.rmsnorm(True)
    if moe:
        mlp_saved = moe_mlp_saved(step) + step.rmsnorm(True)  # upper bound of the freed part
    if cand.attn == "eager":
        # at the softmax backward: the probabilities' and the scores' gradients, the gradient of
        # v and of the hidden state; o_proj's input and the repeated v are already freed
        attn_extra = (d + 4) * b * nh * s * s + d * t * qd + d * t * h
        freed = (1 if step.trainable(linear_names(arch)["o"]) else 0) + (1 if nkv < nh else 0)
        attn_extra -= d * t * qd * freed
    else:
        attn_extra = 2 * d * t * (qd + 2 * kvd) + 2 * d * t * h
    if moe and step.full and cand.zero < 2:
        # the experts' and the router's weight gradients appear in the MoE block's backward
        # (at its peak, down_proj's E x h x I_e; all of them, E x 3 x h x I_e + E x h, through
        # the attention's), as phases._in_layer_backward counts the nn.Linear layers' (ZeRO-2/3
        # move them into partitions as they arrive)
        E = arch.num_experts
        mlp_extra += d * E * h * arch.moe_intermediate_size
        attn_extra += d * (E * arch.expert_params() + E * h)
    return mlp_extra, attn_extra - mlp_saved


def _attention_forward(cand: Candidate, step: MicroStep) -> tuple[int, int]:
    """Forward transients of one attention call and the additive mask: eager materialises the
    scores (matmul output, scaled copy, masked copy: two alive at a time; the softmax output is
    fp32) next to the additive mask transformers builds once per forward ([b, 1, s, s] in the
    model dtype, masking_utils.eager_mask) and the repeat_kv'd keys/values; sdpa/flash only
    q, k, v, out. Returns (transient bytes, mask bytes)."""
    arch, d, b, s, t = step.arch, step.dtype, step.seqs, step.seq_len, step.tokens
    qd, kvd = arch.num_attention_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    if cand.attn != "eager":
        return d * t * (2 * qd + 2 * kvd), 0
    mask = d * b * s * s
    scores = max(2 * d, d + 4) * b * arch.num_attention_heads * s * s
    return scores + mask + d * t * (3 * qd + 2 * kvd), mask


def activations(arch: ModelArch, cand: Candidate, method: str, settings: Settings) -> Activations:
    """Bytes autograd keeps for one micro step, tensor by tensor as transformers' Llama/Qwen2
    decoder layer saves them (see `_layer_saved`), plus the final norm, the loss's logit terms,
    the rotary table, the batch's int64 tensors and the transients of forward and backward."""
    step = micro_step(arch, cand, method, settings)
    d, t, h, L = step.dtype, step.tokens, arch.hidden_size, arch.num_layers
    # MoE models: MoE layers and dense layers save different tensors (`moe_layers()`)
    n_moe = len(arch.moe_layers())
    moe_layer = _layer_saved(cand, settings, step, moe=True) if n_moe else 0
    dense_layer = _layer_saved(cand, settings, step) if n_moe < L else 0
    layer = max(moe_layer, dense_layer)
    all_layers = n_moe * moe_layer + (L - n_moe) * dense_layer
    acts = Activations(per_layer=layer)
    if cand.attn == "eager":
        acts.attention_scores = L * _eager_probabilities(step)
    _head_terms(acts, arch, cand, method, step, settings)
    rope = 2 * 4 * step.seq_len * arch.head_dim  # cos and sin, shared by all layers (fp32)
    # int64 input ids, attention mask and labels of every sequence collated (KTO: the KL batch too);
    # padding_free: input ids, labels and position ids of the one row (memfit.train.batches.padding_free_batch)
    ids = 3 * 8 * forward_seqs(cand, method) * (step.seq_len if not step.packed_seqs else cand.seq_len)
    if cand.grad_ckpt:
        # torch.utils.checkpoint (non-reentrant, transformers' default) keeps each layer's input.
        # Only in train mode: `GradientCheckpointingLayer.forward_with_checkpointing`
        # (transformers modeling_layers.py) checkpoints when `self.training`, and `from_pretrained`
        # returns the model in eval mode; a trainer that never calls `.train()` keeps every
        # layer's tensors (the no-checkpointing estimate; tests/test_estimate_deepspeed.py).
        kept = L * d * t * h
        acts.kept_per_layer = d * t * h
        # the recomputed layer shares its input with the checkpoint (no copy in fp32)
        acts.recompute = layer - (4 * t * h if d == 4 else 0)
    else:
        kept = all_layers
        if not step.full:  # layer 0's first norm sees the frozen embedding output: nothing to save
            qkv_saved = any(step.trainable(n) for n in linear_names(arch)["qkv"])
            kept -= step.rmsnorm(qkv_saved) - step.rmsnorm(qkv_saved, needs_grad=False)
        acts.kept_per_layer = layer
    acts.saved = kept + acts.final + acts.logits_saved + rope + ids
    acts.mlp_bwd, acts.attn_bwd = _layer_backward_transients(cand, step)
    if n_moe:  # the largest of an MoE layer's and a dense layer's transients
        moe_mlp, moe_attn = _layer_backward_transients(cand, step, moe=True)
        if n_moe == L:
            acts.mlp_bwd, acts.attn_bwd = moe_mlp, moe_attn
        else:
            acts.mlp_bwd, acts.attn_bwd = max(acts.mlp_bwd, moe_mlp), max(acts.attn_bwd, moe_attn)
    acts.layer_bwd = max(acts.mlp_bwd, acts.attn_bwd)
    attn_fwd, mask = _attention_forward(cand, step)
    once = _padding_mask_once(cand, settings, step)  # sdpa's bool mask (eager's is `mask`)
    mask += once
    if cand.grad_ckpt:
        acts.saved += mask  # the checkpoint keeps the mask among the layer's inputs
    kept_before_last = kept - (acts.kept_per_layer if not cand.grad_ckpt else 0)
    layer_fwd = attn_fwd
    if step.tile_rows:  # the tiles' outputs and their concatenation, one tile's intermediates
        layer_fwd = max(attn_fwd, 2 * d * t * h + 3 * d * step.tile_rows * arch.intermediate_size)
    if n_moe:  # the last layer's MoE block (its saved tensors and transients) may top attention
        layer_fwd = max(attn_fwd, moe_layer + _moe_forward_transient(step))
    acts.forward = kept_before_last + rope + ids + layer_fwd + once + 2 * d * t * h
    acts.ref_forward = _nograd_forward(arch, cand, method, step, settings, attn_fwd)
    if cand.kernels == "liger":  # what Liger's RMSNorm and SwiGLU save less than transformers' modules
        liger_terms.adjust(acts, step, cand, n_moe)
    return acts


def _head_terms(acts: Activations, arch: ModelArch, cand: Candidate, method: str, step, settings: Settings) -> None:
    """The final norm's, the head's and the loss's saved tensors and backward transients into
    `acts` (HF ForCausalLMLoss / losses.token_logps; a reward model's score head)."""
    d, t, h, V = step.dtype, step.tokens, arch.hidden_size, arch.vocab_size
    acts.final = step.rmsnorm(step.full)
    if not lm_head(method):
        # a reward model (transformers modeling_layers.GenericForSequenceClassification): the
        # score Linear(h, 1) trains (full, or peft's modules_to_save) and saves the final norm's
        # output; its [t, 1] output indexed at each row's last token keeps two int64 [b] indices.
        # Backward: the indexing's zero-filled [t, 1] gradient, the hidden states' [t, h].
        acts.final = step.rmsnorm(True)
        acts.logits_saved = 2 * 8 * step.seqs
        acts.logits_bwd_extra = d * t * h + d * t
    elif cand.kernels == "liger":  # Liger's fused linear cross-entropy (memfit.train.liger)
        acts.logits_saved, acts.logits_bwd_extra = liger_terms.loss_terms(arch, cand, step.tokens, step.full)
    elif cand.loss_impl == "chunked":
        acts.logits_saved, acts.logits_bwd_extra = chunked_loss_terms(arch, cand, step.tokens, step.full, settings)
    else:
        # memfit's trainer (train.py `loss`) drops the model output before backward, so the logits
        # themselves are gone; log_softmax keeps its fp32 [t, V] output (losses.token_logps).
        acts.logits_saved = 4 * t * V
        # loss backward: gather/nll backward's fp32 [t, V] gradient, then log_softmax_backward's
        acts.logits_bwd_extra = 8 * t * V


def _nograd_forward(arch: ModelArch, cand: Candidate, method: str, step, settings: Settings, attn_fwd: int) -> int:
    """The transient of the forwards without gradient after the policy's (memfit.train.steps, as
    TRL and OpenRLHF): DPO's and KTO's reference, KTO's policy on the KL batch (preference.kto.step:
    one forward each). Beside the policy's saved tensors (its output is dropped once its log-probs
    are taken), one such forward's attention call or its logits, fp32 copy and log-softmax; 0
    without such forwards. `attn_fwd`: the policy's attention call."""
    ng = nograd_forward_seqs(cand, method)
    if not ng:
        return 0
    if ng != step.seqs and not step.packed_seqs:  # padding_free: the reference runs the policy's row
        step = dataclasses.replace(step, seqs=ng)
        attn_fwd, _ = _attention_forward(cand, step)
    d, t, h, V, i = step.dtype, step.tokens, arch.hidden_size, arch.vocab_size, arch.intermediate_size
    # a reference layer's transients: its attention call, or its MLP (the residual stream, the
    # normed input, gate, up and act(gate)*up), which tops the logits where the vocabulary is
    # small next to the MLP width (measured: benchmarks/bench_qlora_memory.py, lora and qlora)
    # (tiled: the input, residual, tiles' outputs and their concatenation, one tile's intermediates)
    mlp = d * t * 4 * h + 3 * d * step.tile_rows * i if step.tile_rows else d * t * (2 * h + 3 * i)
    # ... and, beside the MLP, what the model's forward holds without gradient from the second
    # layer on (transformers' LlamaModel.forward and its kin): the embedding output (`inputs_embeds`,
    # held through every layer) and the layer's input (the decoder loop's `hidden_states` while
    # the layer runs; the MLP's residual is the attention's sum by then). Measured with Liger's
    # loss, where this MLP is the step's peak: 2 d t h short without them.
    mlp += 2 * d * t * h if arch.num_layers > 1 else 0
    attn = attn_fwd + 3 * d * t * h
    if cand.kernels == "liger":  # the reference's log-probs through Liger's loss too (StepRunner's head)
        return max(liger_terms.nograd_loss(arch, cand, t), attn, mlp)
    if cand.loss_impl == "chunked":  # the reference's logits per chunk only
        c = chunk_tokens(arch, t, settings)
        return max(c * V * (d + 8 + (4 if d < 4 else 0)), attn, mlp)
    ref_logits = (d + (4 if d < 4 else 0) + 4) * t * V
    return max(ref_logits, attn, mlp)
