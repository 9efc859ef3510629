"""memfit's chunked loss (`loss_impl: chunked`, memfit.train.vocab_loss): tokens per chunk
(`chunk_tokens`) and what one chunk of [tokens, vocab] logits holds and adds in the backward
(`chunked_loss_terms`), where the full loss would hold all of them."""

from __future__ import annotations

from memfit.estimate.models.arch import ModelArch
from memfit.estimate.settings import Settings, dtype_bytes
from memfit.space import Candidate


def chunk_tokens(arch: ModelArch, tokens: int, settings: Settings) -> int:
    from memfit.train.vocab_loss import default_chunk_tokens

    return min(tokens, settings.loss_chunk_tokens or default_chunk_tokens(arch.vocab_size))


def chunked_loss_terms(
    arch: ModelArch, cand: Candidate, tokens: int, full: bool, settings: Settings
) -> tuple[int, int]:
    """(saved, transient) bytes of memfit.train.vocab_loss's chunked log-probs, every token scored (the
    worst case; a prompt-masked SFT batch projects fewer).

    Saved: the scored hidden states (a d x h copy per token), the fp32 log-sum-exp, the int64
    targets, the scattered fp32 [B, T-1] log-probs and its bool mask. Transient, per chunk of c
    tokens: 8 bytes x c x V either way: the forward's fp32 logits and logsumexp's fp32 exp(x - max);
    the backward's fp32 logits turned in place into their gradient, the d-byte projection before
    its fp32 copy or the cast back (`vocab_loss._linear_backward`, a plain nn.Linear head, which
    memfit's LoRA never adapts). Beside the chunk: the hidden states' gradient (d x h per token)
    and, for a trained head, its gradient buffer (V x h x d).
    """
    d, h, V, t = dtype_bytes(cand.precision), arch.hidden_size, arch.vocab_size, tokens
    c = chunk_tokens(arch, t, settings)
    saved = t * (d * h + 4 + 8) + t * (4 + 1)
    head_grad = V * h * d if full else 0
    return saved, 8 * c * V + t * d * h + head_grad
