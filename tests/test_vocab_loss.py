"""Chunked, recompute-in-backward vocabulary log-probs equal the full logits path."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_close_fp32
from transformers import LlamaConfig, LlamaForCausalLM

from memfit.train.losses import IGNORE_INDEX, token_logps
from memfit.train.vocab_loss import ChunkedHead, chunked_token_logps, default_chunk_tokens


def _model(tied: bool, vocab: int = 300, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg).float()


def _batch(vocab: int, b: int = 3, t: int = 17, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    labels = ids.clone()
    labels[:, :5] = IGNORE_INDEX  # a prompt
    labels[1, -4:] = IGNORE_INDEX  # padding
    return ids, labels


def _reduction_length(model, ids: torch.Tensor) -> int:
    """The longest fp32 accumulation chain of a step of `model` on `ids` (tests/numerics.py): the
    log-softmax over the vocabulary, per layer the matmuls over hidden and intermediate sizes and
    attention over the sequence, then the sum over every token of the batch for a weight gradient."""
    cfg = model.config
    per_layer = cfg.hidden_size + cfg.intermediate_size + ids.shape[1]
    return cfg.vocab_size + cfg.num_hidden_layers * per_layer + ids.numel()


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(model, ids, labels, chunk: int | None, impl: str):
    model.zero_grad(set_to_none=True)
    if impl == "full":
        logps, mask = token_logps(model(input_ids=ids).logits, labels)
    else:
        with ChunkedHead(model, chunk).targets(labels) as head:
            logps = model(input_ids=ids).logits
        mask = head.mask
    # SFT's mean NLL plus a DPO-like sequence term, so both reductions reach the gradient
    loss = -logps.sum() / mask.sum() + 0.3 * torch.nn.functional.logsigmoid(logps.sum(-1)[0] - logps.sum(-1)[-1])
    loss.backward()
    return logps.detach(), _grads(model)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, None])
def test_chunked_equals_full_logps_and_grads(tied, chunk):
    model = _model(tied)
    ids, labels = _batch(300)
    full_lp, full_g = _run(model, ids, labels, chunk, "full")
    ch_lp, ch_g = _run(model, ids, labels, chunk, "chunked")
    assert_close_fp32(ch_lp, full_lp, _reduction_length(model, ids), "log-probs")
    assert full_g.keys() == ch_g.keys() and "lm_head.weight" in full_g or tied
    for name in full_g:
        assert_close_fp32(ch_g[name], full_g[name], _reduction_length(model, ids), name)


def test_plain_linear_head_with_bias():
    """The in-place backward of a plain nn.Linear head (weight and bias gradients accumulated)."""
    model = _model(tied=False)
    model.lm_head = torch.nn.Linear(32, 300, bias=True)
    torch.nn.init.normal_(model.lm_head.bias, std=0.5)
    ids, labels = _batch(300)
    full_lp, full_g = _run(model, ids, labels, 5, "full")
    ch_lp, ch_g = _run(model, ids, labels, 5, "chunked")
    assert_close_fp32(ch_lp, full_lp, _reduction_length(model, ids), "log-probs")
    assert {"lm_head.weight", "lm_head.bias"} <= ch_g.keys() and full_g.keys() == ch_g.keys()
    for name in full_g:
        assert_close_fp32(ch_g[name], full_g[name], _reduction_length(model, ids), name)


def test_head_bias_and_lora_head():
    from peft import LoraConfig, get_peft_model

    base = _model(tied=False)
    base.lm_head = torch.nn.Linear(32, 300, bias=True)
    torch.nn.init.normal_(base.lm_head.bias, std=0.5)
    model = get_peft_model(
        base,
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], lora_dropout=0.0, init_lora_weights=False),
    )
    ids, labels = _batch(300)
    full_lp, full_g = _run(model, ids, labels, 5, "full")
    ch_lp, ch_g = _run(model, ids, labels, 5, "chunked")
    assert_close_fp32(ch_lp, full_lp, _reduction_length(model, ids), "log-probs")
    assert any("lm_head.lora_A" in n for n in ch_g)
    assert full_g.keys() == ch_g.keys()
    for name in full_g:
        assert_close_fp32(ch_g[name], full_g[name], _reduction_length(model, ids), name)


def test_no_full_logits_tensor_exists():
    """The largest fp32 tensor alive in the loss is a chunk of logits, never tokens x vocab."""
    from memfit.train.memory import AllocationTracker

    vocab, b, t = 8000, 2, 257
    model = _model(tied=False, vocab=vocab)
    ids, labels = _batch(vocab, b, t)
    labels[:, :] = ids  # score every token
    peaks = {}
    for impl in ("full", "chunked"):
        model.zero_grad(set_to_none=True)
        with AllocationTracker("cpu") as tr:
            _run(model, ids, labels, 64, impl)
        peaks[impl] = tr.peak_bytes - tr.baseline_bytes
    full_logits = b * t * vocab * 4
    # the full path holds logits, their log-softmax and their gradient (>= 3 copies) at its peak;
    # the rest of the step (eager attention's probabilities, weights, grads) is common to both
    assert peaks["full"] - peaks["chunked"] > 2 * full_logits, peaks


def test_no_grad_and_nothing_scored():
    model = _model(tied=False)
    ids, labels = _batch(300)
    with torch.no_grad():
        a, _ = token_logps(model(input_ids=ids).logits, labels)
        b, _ = chunked_token_logps(model.model(input_ids=ids).last_hidden_state, labels, model.lm_head, 4)
    assert_close_fp32(b, a, _reduction_length(model, ids), "log-probs")
    none = torch.full_like(labels, IGNORE_INDEX)
    h = model.model(input_ids=ids).last_hidden_state
    lp, mask = chunked_token_logps(h, none, model.lm_head)
    assert not mask.any() and float(lp.abs().sum()) == 0.0
    lp.sum().backward()  # still part of the graph


def test_default_chunk_is_a_fixed_logits_budget():
    # 256 MiB of fp32 logits: 256 tokens of Gemma-3 (262,144) and Qwen2 (151,936), 2,048 of Llama-2 (32,000)
    assert default_chunk_tokens(262144) == 256
    assert default_chunk_tokens(151936) == 256
    assert default_chunk_tokens(32000) == 2048
    assert default_chunk_tokens(321) == 2**17  # a tiny vocabulary: the whole batch in one chunk
    assert default_chunk_tokens(10**9) == 64  # never fewer than 64 tokens


def test_softcapping_refused():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        final_logit_softcapping=30.0,
    )
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        ChunkedHead(Gemma2ForCausalLM(cfg))
