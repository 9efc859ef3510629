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
v are gathered into blocks of [sequences, heads, longest, head_dim] (one, or two where one long
sequence would pad many short ones: `split_blocks`), torch's SDPA runs causal on each (its own
GQA; no mask), and the output is gathered back into the row's token order. Right padding of a
sequence is harmless under a causal mask: a real query attends to earlier positions only, all of
them real, and the padded queries' outputs are never read back. So a sequence costs about its own
square, as under flash-attention's varlen kernel (`cu_seqlens`), whose argument names the batch
carries (`seq_lens_kwargs`; transformers' FlashAttentionKwargs), and the layers outside attention
still compute only the rows' own tokens.

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
    (flash-attention's varlen arguments), and `memfit_blocks` (`block_plan`), the blocks memfit's
    per-sequence sdpa runs: found here once per forward, not in every layer."""
    flat = position_ids.reshape(-1)
    starts = (flat == 0).nonzero().view(-1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("padding-free position ids must start every sequence at 0, the first token included")
    cu = torch.cat((starts, torch.tensor([flat.numel()], device=flat.device))).to(torch.int32)
    lengths = cu.diff().tolist()
    longest = max(lengths)
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
        "memfit_blocks": block_plan(lengths, flat.device),
    }


def split_blocks(lengths: list[int]) -> list[list[int]]:
    """The sequences (indices into `lengths`) of each block, longest first: one block, or two where
    that computes less. A block pads its sequences to its longest, and a causal attention block of
    S sequences of M positions costs S x M^2 (the scores and their products with V, forward and
    backward: FlashAttention-2's FLOP count, Dao 2023, sec. 4.1, per sequence), so one long
    sequence among short ones (heavy-tailed lengths) would make every sequence cost the longest's
    square. The best split of the sequences sorted by length, if it saves a quarter of the
    single block's cost (a second SDPA call and its gathers cost something too); at most two
    blocks, so a compiled layer sees two graph structures at most (memfit.train.compile)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    sorted_len = [lengths[i] for i in order]
    n, top = len(order), sorted_len[0]
    single = n * top * top
    best_cost, best_j = single, n
    for j in range(1, n):  # the first j sequences in a block of the longest; the rest of the j-th
        cost = j * top * top + (n - j) * sorted_len[j] ** 2
        if cost < best_cost:
            best_cost, best_j = cost, j
    if best_j == n or best_cost > 0.75 * single:
        return [order]
    return [order[:best_j], order[best_j:]]


def block_plan(
    lengths: list[int], device: torch.device
) -> tuple[tuple[tuple[torch.Tensor, int, int], ...], torch.Tensor]:
    """The gathers of `varlen_sdpa` for sequences of `lengths` laid end to end: per block
    (`split_blocks`) the token each of its [sequences x longest] slots reads (a sequence's own, or
    token 0 where the block pads it), its sequences and its longest; and, for each token, its
    slot in the blocks laid end to end, where its output is read back."""
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    slot_of = torch.empty(starts[-1] + lengths[-1], dtype=torch.long)
    blocks, offset = [], 0
    for members in split_blocks(lengths):
        longest = lengths[members[0]]
        reads = torch.zeros(len(members) * longest, dtype=torch.long)
        for k, seq in enumerate(members):  # a slice a sequence, built on the host, then moved once
            n, first = lengths[seq], k * longest
            reads[first : first + n] = torch.arange(starts[seq], starts[seq] + n)
            slot_of[starts[seq] : starts[seq] + n] = torch.arange(offset + first, offset + first + n)
        blocks.append((reads.to(device), len(members), longest))
        offset += len(members) * longest
    return tuple(blocks), slot_of.to(device)


def varlen_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: tuple[tuple[tuple[torch.Tensor, int, int], ...], torch.Tensor],
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of every sequence over itself. query [B, heads, L, d], key and value
    [B, kv_heads, L, d] (the B x L tokens in order), `plan` their blocks (`block_plan`); returns
    [B, L, heads, d], transformers' attention-function layout. Each block's slots gather their
    tokens (a padding slot lies after its sequence's last position, so under the causal mask no
    real query sees it, and its own query's output is never read back: it adds exact zeros to
    every gradient; a gather keeps only its index for the backward, where index_copy into a zero
    block would keep its source, q, k and v, a second time beside SDPA's saved block: measured +2 x
    tokens x q_dim a layer). `sliding_window` (Mistral, Qwen2's sliding layers): a query sees the
    keys less than that many positions back (transformers masking_utils.py
    `sliding_window_causal_mask_function`: kv_idx > q_idx - sliding_window), as a [longest,
    longest] mask shared by a block's sequences, where they are longer than the window."""
    b, heads, length, _ = query.shape
    tokens = b * length
    blocks, slot_of = plan
    if not torch.compiler.is_compiling() and slot_of.numel() != tokens:
        raise ValueError(f"the sequences cover {slot_of.numel()} tokens, the batch has {tokens}")
    q, k, v = (x.transpose(1, 2).reshape(tokens, x.shape[1], x.shape[3]) for x in (query, key, value))
    outs = [_attend(q, k, v, block, heads, scaling, dropout, sliding_window) for block in blocks]
    out = (torch.cat(outs) if len(outs) > 1 else outs[0]).index_select(0, slot_of)
    return out.view(b, length, heads, out.shape[-1])


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block: tuple[torch.Tensor, int, int],
    heads: int,
    scaling: float | None,
    dropout: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One block of `varlen_sdpa`: q, k, v [tokens, h, d] gathered into [seqs, h, longest, d], SDPA
    on them, the output as [seqs x longest, heads, d]."""
    reads, seqs, longest = block

    def padded(x: torch.Tensor) -> torch.Tensor:
        return x.index_select(0, reads).view(seqs, longest, x.shape[1], x.shape[2]).transpose(1, 2)

    window = None
    if sliding_window is not None and longest > sliding_window:
        at = torch.arange(longest, device=q.device)
        back = at[:, None] - at[None, :]
        window = (back >= 0) & (back < sliding_window)
    out = torch.nn.functional.scaled_dot_product_attention(
        padded(q),
        padded(k),
        padded(v),
        attn_mask=window,
        dropout_p=dropout,
        scale=scaling,
        is_causal=window is None,
        enable_gqa=k.shape[1] != heads,
    )
    return out.transpose(1, 2).reshape(seqs * longest, heads, out.shape[-1])


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
    plan = kwargs.pop("memfit_blocks", None)
    cu = kwargs.pop("cu_seq_lens_q", None)
    if cu is not None and attention_mask is None:
        if plan is None:  # flash-attention's arguments alone: the plan from them (a host sync a layer)
            plan = block_plan(cu.diff().tolist(), query.device)
        return varlen_sdpa(query, key, value, plan, scaling, dropout, kwargs.get("sliding_window")), None
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
