"""Per-token log-probabilities through the LM head without the full fp32 logits.

At long context the logits are the largest tensors of a training step: the head projects every
position onto the vocabulary, and the loss (`memfit.train.losses.token_logps`) upcasts them to fp32 and
takes a log-softmax, so a step holds tokens x vocab x (2 + 4 + 4) bytes and more. Here the head
projection, the log-sum-exp and the gathered log-prob of the target token run over chunks of
tokens inside one `torch.autograd.Function` that saves only the hidden states, the per-token
log-sum-exp (fp32, one number a token) and the targets; the backward recomputes each chunk's
logits. The same recompute-in-backward scheme as Wijmans et al. 2024, "Cut Your Losses in
Large-Vocabulary Language Models" (Apple's Cut Cross-Entropy) and TRL's `chunked_nll`, in plain
PyTorch so that it runs on the CPU and the GPU alike.

Only scored positions (labels != IGNORE_INDEX) are projected at all, so an SFT batch with the
loss on responses never computes the prompt's logits.

The head is called as the model's own module code (`type(head).forward`), so a LoRA-wrapped head,
a bias, tied embeddings and DeepSpeed ZeRO-3 (whose hooks gather the head's partitioned weight
around the head module's forward and backward, `deepspeed/runtime/zero/parameter_offload.py`)
work unchanged. The backward takes the head parameters' gradients with `torch.autograd.grad` per
chunk and returns their sum, so each parameter's gradient is accumulated once per step (ZeRO-1/2
reduce a gradient exactly once: `stage_1_and_2.py`, "Gradient computed twice for this partition").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

IGNORE_INDEX = -100  # HF convention: CrossEntropyLoss(ignore_index=-100) skips these labels


CHUNK_LOGITS_BYTES = 256 * 2**20  # fp32 logits of one chunk: a fixed transient, whatever the context


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk: the largest power of two whose fp32 logits fit CHUNK_LOGITS_BYTES, at least 64.

    A fixed budget keeps the loss's transient independent of the sequence length (the point of
    chunking). Not Liger-Kernel's `next_power_of_2(cdiv(BT, cdiv(V, H)))`
    (`liger_kernel/ops/fused_linear_cross_entropy.py`): that suits its fused kernel, but here every
    chunk's backward also adds a [V, H] weight gradient, so chunks of a few tokens (Liger's choice for
    a 150k vocabulary at small H) spend the step on that memory traffic; measured in
    benchmarks/bench_vocab_loss.py.
    """
    fit = CHUNK_LOGITS_BYTES // (4 * max(vocab_size, 1))
    return max(64, 1 << max(fit, 1).bit_length() - 1)


class _ChunkedLogProbs(torch.autograd.Function):
    """log p(target) per row of `hidden` [N, H] under `head_fn`, in chunks of `chunk` rows.

    `params` are the head's trainable parameters: inputs of the Function so that autograd hands
    their gradients (summed over chunks) to their accumulators once.
    """

    @staticmethod
    def forward(ctx, hidden, targets, head_fn, chunk, *params):
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        out = torch.empty(n, dtype=torch.float32, device=hidden.device)
        with torch.no_grad():
            for s in range(0, n, chunk):
                logits = head_fn(hidden[s : s + chunk]).float()
                lse[s : s + chunk] = torch.logsumexp(logits, dim=-1)
                out[s : s + chunk] = logits.gather(1, targets[s : s + chunk, None]).squeeze(1) - lse[s : s + chunk]
                del logits
        ctx.head_fn, ctx.chunk, ctx.params = head_fn, chunk, params
        ctx.linear = getattr(head_fn, "linear", None)
        ctx.save_for_backward(hidden, targets, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.linear is not None:
            return _linear_backward(ctx, grad_out)
        hidden, targets, lse = ctx.saved_tensors
        want_hidden = ctx.needs_input_grad[0]
        wanted = [p for p, need in zip(ctx.params, ctx.needs_input_grad[4:], strict=True) if need]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grads: dict[int, torch.Tensor] = {}
        grad_out = grad_out.float()
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s : s + ctx.chunk].detach().requires_grad_(want_hidden)
            t, g = targets[s : s + ctx.chunk], grad_out[s : s + ctx.chunk]
            with torch.enable_grad():
                logits = ctx.head_fn(h)
            # d log p(t) / d logits = onehot(t) - softmax(logits), the softmax from the saved lse
            d = (logits.detach().float() - lse[s : s + ctx.chunk, None]).exp_().mul_(-g[:, None])
            d.scatter_add_(1, t[:, None], g[:, None])
            inputs = ([h] if want_hidden else []) + wanted
            got = list(torch.autograd.grad(logits, inputs, grad_outputs=d.to(logits.dtype), allow_unused=True))
            del logits, d
            if want_hidden:
                grad_hidden[s : s + ctx.chunk] = got.pop(0)
            for p, gp in zip(wanted, got, strict=True):
                if gp is not None:
                    grads[id(p)] = gp if id(p) not in grads else grads[id(p)].add_(gp)
        param_grads = [
            grads.get(id(p)) if need else None for p, need in zip(ctx.params, ctx.needs_input_grad[4:], strict=True)
        ]
        return (grad_hidden, None, None, None, *param_grads)


def _linear_backward(ctx, grad_out):
    """The backward for a plain `nn.Linear` head, in place: one chunk of logits at a time becomes
    its own gradient (softmax - onehot, scaled), and the weight and bias gradients accumulate into
    one buffer each (addmm_), so a chunk costs one [chunk, V] block and no [V, H] temporaries."""
    hidden, targets, lse = ctx.saved_tensors
    weight, bias = ctx.linear
    need = dict(zip(map(id, ctx.params), ctx.needs_input_grad[4:], strict=True))
    grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
    grad_w = torch.zeros_like(weight) if need.get(id(weight)) else None
    grad_b = torch.zeros_like(bias) if bias is not None and need.get(id(bias)) else None
    grad_out = grad_out.float()
    with torch.no_grad():
        for s in range(0, hidden.shape[0], ctx.chunk):
            h, t, g = hidden[s : s + ctx.chunk], targets[s : s + ctx.chunk], grad_out[s : s + ctx.chunk]
            d = torch.nn.functional.linear(h, weight, bias).float()  # a copy unless already fp32
            # d log p(t) / d logits = onehot(t) - softmax(logits), the softmax from the saved lse
            d.sub_(lse[s : s + ctx.chunk, None]).exp_().mul_(-g[:, None]).scatter_add_(1, t[:, None], g[:, None])
            d = d.to(weight.dtype)
            if grad_hidden is not None:
                torch.mm(d, weight, out=grad_hidden[s : s + ctx.chunk])
            if grad_w is not None:
                grad_w.addmm_(d.t(), h)
            if grad_b is not None:
                grad_b.add_(d.sum(0))
            del d
    by_id = {id(weight): grad_w} | ({id(bias): grad_b} if bias is not None else {})
    return (grad_hidden, None, None, None, *(by_id.get(id(p)) for p in ctx.params))


def chunked_token_logps(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: nn.Module,
    chunk_tokens: int | None = None,
    head_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    shifted: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log p(label) for next-token prediction, and the mask of scored tokens.

    Same contract as `memfit.train.losses.token_logps(head(hidden), labels, shifted)`: hidden
    [B, T, H] at position t predicts labels[:, t + 1] (`shifted`: labels[:, t]); returns fp32
    log-probs [B, T - 1] ([B, T] shifted; 0 where not scored) and the boolean mask. `head_fn`
    computes a chunk's logits (default: the head module's own forward, bypassing module hooks,
    which the caller's module call has already run).
    """
    if not shifted:
        labels, hidden = labels[:, 1:], hidden[:, :-1]
    mask = labels != IGNORE_INDEX
    h = hidden[mask]  # [N, H] scored positions only
    targets = labels[mask]
    out = torch.zeros(labels.shape, dtype=torch.float32, device=hidden.device)
    if h.shape[0] == 0:
        return out + 0.0 * hidden.sum(-1).float(), mask  # keep the graph connected
    fn = head_fn or _head_fn(head)
    vocab = _vocab_size(head, fn, h)
    chunk = chunk_tokens or default_chunk_tokens(vocab)
    params = [p for p in head.parameters() if p.requires_grad] if torch.is_grad_enabled() else []
    logps = _ChunkedLogProbs.apply(h, targets, fn, chunk, *params)
    out = out.masked_scatter(mask, logps)
    return out, mask


def _head_fn(head: nn.Module):
    """The head's own forward, bypassing module hooks (the caller's module call ran them); a plain
    `nn.Linear` head also carries its (weight, bias) for the in-place backward."""

    def fn(x):
        return type(head).forward(head, x)

    if type(head) is nn.Linear:
        fn.linear = (head.weight, head.bias)
    return fn


def _vocab_size(head: nn.Module, fn, h: torch.Tensor) -> int:
    out_features = getattr(head, "out_features", None)
    if isinstance(out_features, int):
        return out_features
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.numel() > 0:
        return weight.shape[0]
    with torch.no_grad():
        return fn(h[:1]).shape[-1]


class HeadTargets:
    """Turns a causal LM's output head into a per-token log-prob head while active: the
    interception the chunked loss (`ChunkedHead`) and Liger's fused one (memfit.train.liger
    `LigerHead`) share; a subclass says how the head's log-probs are computed (`_logps`).

    Inside `with head.targets(labels):` the model's forward returns, as `.logits`, the fp32
    log-probs [B, T - 1] of `labels` (shifted as for next-token prediction; `shifted`: already),
    and `.mask` the scored tokens. The head module keeps its identity (DeepSpeed's hooks stay on
    it, so ZeRO-3 gathers its weight for the call); only its bound `forward` is replaced while active.
    """

    def __init__(self, head: nn.Module) -> None:
        self.head = head
        self._labels: torch.Tensor | None = None
        self._shifted = False
        self.mask: torch.Tensor | None = None

    def _logps(self, hidden: torch.Tensor, labels: torch.Tensor, shifted: bool) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self._labels is not None
        logps, self.mask = self._logps(hidden, self._labels, self._shifted)
        return logps

    @contextlib.contextmanager
    def targets(self, labels: torch.Tensor, shifted: bool = False) -> Iterator[HeadTargets]:
        self._labels, self._shifted = labels, shifted
        self.head.forward = self._forward  # instance attribute: module __call__ (and its hooks) run it
        try:
            yield self
        finally:
            del self.head.forward
            self._labels = None


class ChunkedHead(HeadTargets):
    """`HeadTargets` computing the log-probs chunk by chunk (`chunked_token_logps`): inside
    `with ChunkedHead(model, chunk).targets(labels):` the full logits never exist."""

    def __init__(self, model: nn.Module, chunk_tokens: int | None = None) -> None:
        head = model.get_output_embeddings()
        if head is None:
            raise ValueError("the model has no output embeddings (lm_head): loss_impl chunked needs one")
        cfg = getattr(model, "config", None)
        text_cfg = getattr(cfg, "get_text_config", lambda: cfg)() if cfg is not None else None
        cap = getattr(text_cfg, "final_logit_softcapping", None)
        if cap:
            raise ValueError(
                f"final_logit_softcapping={cap} is not supported by loss_impl chunked "
                "(the head's logits are capped after the projection); use loss_impl: full"
            )
        super().__init__(head)
        self.chunk_tokens = chunk_tokens

    def _logps(self, hidden: torch.Tensor, labels: torch.Tensor, shifted: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return chunked_token_logps(hidden, labels, self.head, self.chunk_tokens, shifted=shifted)
