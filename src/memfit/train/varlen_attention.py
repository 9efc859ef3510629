"""Padding-free attention under sdpa without the row's T x T mask: each sequence attends over itself.

A padding-free micro batch is one row of T tokens, its sequences concatenated with position ids
restarting per sequence (memfit.train.batches.collate_packed). Given only those position ids,
transformers 5.24 builds a block-causal [1, 1, T, T] mask for sdpa (masking_utils.py
`find_packed_sequence_indices`, `sdpa_mask`), and torch's SDPA then computes the whole T x T
square of scores, masked, and keeps an additive copy of the mask for its backward: measured on the
CPU, rows of 80 tokens or more stepped slower padding-free than padded (0.47-0.99x,
benchmarks/results/padding_free_cpu.json before this module).

`NAME` is an attention implementation registered with transformers (modeling_utils.py
`AttentionInterface`, masking_utils.py `AttentionMaskInterface`; their documented way to add one)
that keeps padding-free's token layout everywhere except the attention core: the layer's q, k and
v are scattered into [sequences, heads, longest, head_dim], torch's SDPA runs causal on them (its
own GQA; no mask), and the output is gathered back into the row's token order. Right padding of a
sequence is harmless under a causal mask: a real query attends to earlier positions only, all of
them real, and the padded queries' outputs are never gathered. So a sequence costs its own square,
as under flash-attention's varlen kernel (`cu_seqlens`), whose argument names the batch carries
(`seq_lens_kwargs`; transformers' FlashAttentionKwargs), and the layers outside attention still
compute only the rows' own tokens.

memfit loads a model with it where a candidate is padding_free under sdpa
(memfit.train.modeling.attn_implementation). A batch with a 2-D attention mask (a padded batch)
gets transformers' own sdpa mask and attention, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

NAME = "memfit_sdpa_varlen"


def seq_lens_kwargs(position_ids: torch.Tensor) -> dict[str, Any]:
    """The sequences of a padding-free batch from its position ids ([B, L]; a new sequence wherever
    a position is 0, as transformers' modeling_flash_attention_utils.py
    `prepare_fa_kwargs_from_position_ids` reads them), flattened over the batch: cumulative lengths
    `cu_seq_lens_q`/`_k` (int32, [sequences + 1]) and the longest, `max_length_q`/`_k`, a Python int
    (the padded block's length; computed here once per forward, not in every layer)."""
    flat = position_ids.reshape(-1)
    starts = (flat == 0).nonzero().view(-1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("padding-free position ids must start every sequence at 0, the first token included")
    cu = torch.cat((starts, torch.tensor([flat.numel()], device=flat.device))).to(torch.int32)
    longest = int(cu.diff().max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def _slots(cu: torch.Tensor, longest: int, tokens: int) -> torch.Tensor:
    """Each token's place in the padded block [sequences x longest]: sequence x longest + position."""
    lengths = cu.diff().long()
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths, output_size=tokens)
    return torch.arange(tokens, device=cu.device) - cu[:-1].long()[seq] + seq * longest


def varlen_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    max_length: int,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of every sequence over itself. query [B, heads, L, d], key and value
    [B, kv_heads, L, d] (the B x L tokens in order, `cu_seq_lens` over them); returns [B, L, heads,
    d], transformers' attention-function layout. `sliding_window` (Mistral, Qwen2's sliding layers):
    a query sees the keys less than that many positions back (transformers masking_utils.py
    `sliding_window_causal_mask_function`: kv_idx > q_idx - sliding_window), as a [longest, longest]
    mask shared by every sequence, where a sequence is longer than the window."""
    b, heads, length, _ = query.shape
    tokens = b * length
    if not torch.compiler.is_compiling() and int(cu_seq_lens[-1]) != tokens:
        raise ValueError(f"cu_seq_lens covers {int(cu_seq_lens[-1])} tokens, the batch has {tokens}")
    slots = _slots(cu_seq_lens, max_length, tokens)
    seqs = cu_seq_lens.numel() - 1
    # each slot of the block reads a token: its own, or token 0 where the block pads a sequence.
    # Padding slots lie after their sequence's last position, so under the causal mask no real
    # query sees them, and their own queries' outputs are never gathered: they add exact zeros to
    # every gradient. A gather (index_select) keeps only its index for the backward, where
    # index_copy into a zero block would keep its source, the layer's q, k and v, a second time
    # beside SDPA's saved block (measured: +2 x tokens x q_dim a layer)
    reads = torch.zeros(seqs * max_length, dtype=torch.long, device=query.device)
    reads[slots] = torch.arange(tokens, device=query.device)

    def padded(x: torch.Tensor) -> torch.Tensor:  # [B, h, L, d] -> [sequences, h, longest, d]
        x = x.transpose(1, 2).reshape(tokens, x.shape[1], x.shape[3]).index_select(0, reads)
        return x.view(seqs, max_length, x.shape[1], x.shape[2]).transpose(1, 2)

    window = None
    if sliding_window is not None and max_length > sliding_window:
        at = torch.arange(max_length, device=query.device)
        back = at[:, None] - at[None, :]
        window = (back >= 0) & (back < sliding_window)
    out = torch.nn.functional.scaled_dot_product_attention(
        padded(query),
        padded(key),
        padded(value),
        attn_mask=window,
        dropout_p=dropout,
        scale=scaling,
        is_causal=window is None,
        enable_gqa=key.shape[1] != heads,
    )
    out = out.transpose(1, 2).reshape(seqs * max_length, heads, out.shape[-1]).index_select(0, slots)
    return out.view(b, length, heads, out.shape[-1])


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface (integrations/sdpa_attention.py
    `sdpa_attention_forward`'s signature). With `cu_seq_lens_q` (a padding-free batch): `varlen_sdpa`.
    Without: transformers' sdpa on the mask `mask` built, which is None only for a batch given no
    2-D mask; position ids that restart there would mean packed sequences with nothing to separate
    them, so they are refused rather than attended across."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for unsupported in ("softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(
                f"padding_free under sdpa: {type(module).__name__} passes {unsupported}, which memfit's "
                "per-sequence sdpa does not apply; use attn: flash (varlen) or padding_free: false"
            )
    if not (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        raise ValueError(f"padding_free under sdpa: {type(module).__name__} is not causal attention")
    cu = kwargs.pop("cu_seq_lens_q", None)
    if cu is not None and attention_mask is None:
        longest = int(kwargs["max_length_q"])
        return varlen_sdpa(query, key, value, cu, longest, scaling, dropout, kwargs.get("sliding_window")), None
    positions = kwargs.get("position_ids")
    if attention_mask is None and positions is not None and not torch.compiler.is_compiling():
        if bool((positions[..., 1:] - positions[..., :-1] != 1).any()):
            raise ValueError(
                "padding_free under sdpa: position ids restart inside a row but the batch carries no "
                "cu_seq_lens (memfit.train.varlen_attention.seq_lens_kwargs)"
            )
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )


def mask_function(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask for `NAME`: none for a batch given no 2-D mask (padding-free: `attention_forward`
    separates the sequences), transformers' `sdpa_mask` for any other (a padded batch)."""
    from transformers.masking_utils import sdpa_mask

    if kwargs.get("attention_mask") is None:
        return None
    return sdpa_mask(*args, **kwargs)


def register() -> str:
    """Register `NAME` with transformers (idempotent); returns it, for `attn_implementation`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, mask_function)
    return NAME
