"""What a padded forward adds with sdpa attention (`Settings.padding_mask`): per layer the K/V
repeated to every head and the mask in the model's dtype (`_padding_mask_extra`), and once the
bool mask transformers builds per forward (`_padding_mask_once`); a forward of one sequence is
never padded (`_padded`). The formulas add them (memfit.estimate.memory.activation_memory), and
so do traced activations, traced without a mask (`padding_mask_extra`, `padding_mask_once`)."""

from __future__ import annotations

from memfit.estimate.memory.micro_step import MicroStep, micro_step
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.settings import Settings
from memfit.space import Candidate


def _padded(cand: Candidate, settings: Settings, step: MicroStep) -> bool:
    """Whether the sdpa forward carries a padding mask: rows of different lengths padded to the
    longest (`Settings.padding_mask`), which takes 2+ sequences. A forward of one sequence is
    never padded (memfit.train.batches.collate pads to the longest row of the micro batch; the
    probe fills its row with real tokens, batches.fill_row): transformers drops its all-ones mask
    (masking_utils `_ignore_causal_mask_sdpa`) and SDPA runs causal with its own GQA. Under
    sequence parallelism memfit passes positions, no mask (Ulysses masks causally from them:
    memfit.train.sequence_parallel.shard_batch).

    padding_free (`MicroStep.packed_seqs`): the one row carries no mask under sdpa either: memfit
    runs it through its per-sequence sdpa (memfit.train.varlen_attention, no mask built, SDPA's
    causal kernel and own GQA on each sequence's block; `varlen_attention.mask_function`), whatever
    `Settings.padding_mask` says. (Eager's [1, 1, T, T] mask is `_attention_forward`'s.)"""
    if step.packed_seqs:
        return False
    return cand.attn == "sdpa" and settings.padding_mask and step.seqs >= 2 and cand.sequence_parallel <= 1


def _padding_mask_extra(cand: Candidate, settings: Settings, step: MicroStep) -> int:
    """What one sdpa layer saves beyond the maskless case in a padded forward (`_padded`).
    transformers 5.24 builds the [b, 1, s, s] bool mask once per forward (masking_utils.sdpa_mask)
    and hands it to every layer's SDPA as is (integrations/sdpa_attention.py
    `sdpa_attention_forward`: no conversion there); the mask turns off SDPA's own GQA
    (`use_gqa_in_sdpa`: only without a mask), so `repeat_kv` expands k and v to every head and
    SDPA saves those instead of the rotated k and v; and torch's SDPA converts the bool mask to
    an additive one in the query's dtype in every call (aten/src/ATen/native/transformers/
    attention.cpp `convert_boolean_attn_mask`), which its backward keeps: d*b*s^2 per layer. The
    bool mask itself is `_padding_mask_once`. Measured on the CPU (tiny Llama, LoRA, fp32, 2 rows
    of s=512 and 1024 tokens, 8 short, 4 heads over 2 KV heads, no checkpointing): the padded
    step over the same rows unpadded, L x (repeated K/V + 4 b s^2) to the byte
    (tests/test_estimate_padding_mask.py)."""
    if not _padded(cand, settings, step):
        return 0
    arch = step.arch
    nh, nkv = arch.num_attention_heads, arch.num_kv_heads
    d, b, s, t = step.dtype, step.seqs, step.seq_len, step.tokens
    repeated_kv = 2 * d * t * (nh - nkv) * arch.head_dim if nkv < nh else 0
    return repeated_kv + d * b * s * s


def _padding_mask_once(cand: Candidate, settings: Settings, step: MicroStep) -> int:
    """The padded forward's [b, 1, s, s] bool mask (1 byte an element; masking_utils.sdpa_mask via
    create_causal_mask in the model's forward, once per forward): alive through the forward and,
    under checkpointing, through the backward as every checkpointed layer's input (the H200's
    long-context probes: measured allocated over the estimate by s^2 bytes,
    benchmarks/results/gpu_evidence_h200.json, before micro batch 1 stopped being padded)."""
    return step.seqs * step.seq_len**2 if _padded(cand, settings, step) else 0


def padding_mask_extra(arch: ModelArch, cand: Candidate, method: str, settings: Settings) -> int:
    """`_padding_mask_extra` per decoder layer, for activations traced without a mask."""
    return _padding_mask_extra(cand, settings, micro_step(arch, cand, method, settings))


def padding_mask_once(arch: ModelArch, cand: Candidate, method: str, settings: Settings) -> int:
    """`_padding_mask_once`, for activations traced without a mask."""
    return _padding_mask_once(cand, settings, micro_step(arch, cand, method, settings))
