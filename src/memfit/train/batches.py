"""Rows to tensors and rows to ranks: padding, collation (plain and packed SFT) and the
deterministic step schedule that makes resume exact."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from memfit.methods import shape
from memfit.train.losses import IGNORE_INDEX


def _pad(seqs: list[list[int]], value: int, length: int | None = None) -> torch.Tensor:
    n = length or max(len(s) for s in seqs)
    out = torch.full((len(seqs), n), value, dtype=torch.long)
    for i, s in enumerate(seqs):
        s = s[:n]
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def collate(
    method: str, rows: list[dict[str, Any]], pad_id: int, pad_to: int | None = None, loss_on: str = "response"
) -> dict[str, torch.Tensor]:
    """Right-padded tensors. DPO: chosen rows then rejected rows, one forward (OpenRLHF's concatenated_forward).

    SFT `loss_on`: response scores the response tokens only (the prepared labels); all scores
    every token of the row, prompt included (labels = input_ids); padding is never scored.
    """
    if method == "sft":
        ids = [r["input_ids"] for r in rows]
        labels = [r["input_ids"] if loss_on == "all" else r["labels"] for r in rows]
    else:
        ids, labels = [], []
        for key in ("chosen_ids", "rejected_ids"):
            for r in rows:
                p, y = list(r["prompt_ids"]), list(r[key])
                ids.append(p + y)
                labels.append([IGNORE_INDEX] * len(p) + y)
    input_ids = _pad(ids, pad_id, pad_to)
    return {
        "input_ids": input_ids,
        "labels": _pad(labels, IGNORE_INDEX, pad_to),
        "attention_mask": _pad([[1] * len(s) for s in ids], 0, pad_to),
    }


def fill_row(row: dict[str, Any], length: int) -> dict[str, Any]:
    """An SFT row of exactly `length` real tokens: its input ids, and its labels alike, repeated
    from the start (cut at `length`); the probe's worst case for a forward of one sequence.

    Training never pads such a forward (`collate` pads to the longest row of the micro batch), so
    it reaches the attention without a mask: transformers drops an all-ones mask
    (masking_utils `_ignore_causal_mask_sdpa`), SDPA runs causal with its own GQA. A row padded
    to `length` would carry a [1, 1, s, s] mask, turn GQA off (integrations/sdpa_attention.py
    `use_gqa_in_sdpa`: only without a mask) and measure a step training never runs. The
    repeated labels keep the loss finite and every token is one the model runs."""
    ids = list(row["input_ids"])
    if not ids:
        raise ValueError("an empty row cannot be filled to a sequence")
    reps = -(-length // len(ids))
    out = dict(row)
    out["input_ids"] = (ids * reps)[:length]
    if "labels" in row:
        out["labels"] = (list(row["labels"]) * reps)[:length]
    return out


def probe_rows(method: str, rows: list[dict[str, Any]], seq_len: int) -> list[dict[str, Any]]:
    """The probe's worst-case micro batch from the longest `rows` (unpacked): a forward of one
    sequence (the method runs one sequence per row, none without gradient, micro batch 1:
    memfit.methods) as one row of `seq_len` real tokens (`fill_row`), unpadded as training runs
    it; forwards of 2+ sequences as they are, padded to seq_len by the caller (their rows differ
    in length in training too, so training pads them)."""
    one = shape(method)
    if one.nograd_sequences == 0 and one.grad_sequences * len(rows) == 1:
        return [fill_row(rows[0], seq_len)]
    return rows


def _padding_positions(positions: list[int], n: int) -> list[int]:
    """Position ids of `n` padding tokens after a pack whose tokens have `positions`: sequences of
    their own, restarting at 0, none longer than the pack's longest sequence (all of seq_len where
    the pack is empty). A probe pads a padding-free row of short rows to the padded batch's worst
    case (`padding_free_batch` pad_to); one long padding sequence would make per-sequence attention
    (flash-attention varlen, memfit.train.varlen_attention) pad every sequence to it, where
    sequences as long as the rows keep its attention block at the row's tokens."""
    longest = max(positions) + 1 if positions else n
    return [i % max(longest, 1) for i in range(n)]


def collate_packed(
    packs: list[list[dict[str, Any]]],
    pad_id: int,
    pad_to: int | None = None,
    loss_on: str = "response",
    flatten: bool = False,
) -> dict[str, torch.Tensor]:
    """SFT packs (each a list of rows, concatenated) as input_ids, labels and position_ids; no
    attention_mask, on purpose.

    position_ids restart at 0 at every row. With no attention mask, transformers 5 reads packed
    sequences from them (masking_utils.find_packed_sequence_indices: a new sequence wherever a
    position is not the previous one + 1) and builds a block-diagonal causal mask for sdpa and
    eager, so no token attends across a row boundary; flash_attention_2 derives cu_seqlens from
    them (modeling_flash_attention_utils._is_packed_sequence / prepare_fa_kwargs_from_position_ids)
    but only for batch size 1, hence `flatten` ([1, B*L]) for flash. A padding-free row also
    passes the sequences explicitly (memfit.train.steps.StepRunner.row_inputs), which memfit's
    per-sequence sdpa needs (memfit.train.varlen_attention). Padding at the end of a
    pack is never a target; it forms sequences of its own (`_padding_positions`). The first token of
    each row is never a target: unpacked nothing predicts it, packed the previous row's last
    token would. RoPE sees the same positions as unpacked, so the loss equals the unpacked one.
    """
    ids, labels, pos = [], [], []
    for pack in packs:
        i: list[int] = []
        y: list[int] = []
        q: list[int] = []
        for r in pack:
            x = list(r["input_ids"])
            t = x if loss_on == "all" else list(r["labels"])
            i += x
            y += [IGNORE_INDEX] + t[1:]
            q += range(len(x))
        ids.append(i)
        labels.append(y)
        pos.append(q)
    n = pad_to or max(len(s) for s in ids)
    if max(len(s) for s in ids) > n:
        raise ValueError(f"a pack of {max(len(s) for s in ids)} tokens does not fit pad_to={n}")
    out = {
        "input_ids": _pad(ids, pad_id, n),
        "labels": _pad(labels, IGNORE_INDEX, n),
        "position_ids": _pad([q + _padding_positions(q, n - len(q)) for q in pos], 0, n),
    }
    if flatten:
        out = {k: v.reshape(1, -1) for k, v in out.items()}
    return out


class Schedule:
    """Which rows each rank sees at each step: a pure function of (seed, step), so resume is exact.

    Each epoch is a fresh permutation (seed + epoch); a step consumes one global batch
    (micro_batch x grad_accum x world) in order; the tail of an epoch shorter than a
    global batch is skipped (counted in `rows_skipped_per_epoch`).
    """

    def __init__(self, n_rows: int, micro: int, accum: int, world: int, seed: int, unit: str = "training rows") -> None:
        self.n, self.micro, self.accum, self.world, self.seed = n_rows, micro, accum, world, seed
        self.global_batch = micro * accum * world
        self.steps_per_epoch = n_rows // self.global_batch
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"{n_rows} {unit} are fewer than one global batch "
                f"({micro} micro x {accum} accum x {world} ranks = {self.global_batch})"
            )
        self.rows_skipped_per_epoch = n_rows - self.steps_per_epoch * self.global_batch
        self._perm: tuple[int, np.ndarray] | None = None

    def micro_batches(self, step: int, rank: int) -> Iterator[list[int]]:
        epoch, k = divmod(step, self.steps_per_epoch)
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng(self.seed + epoch).permutation(self.n))
        base = k * self.global_batch
        for m in range(self.accum):
            start = base + (m * self.world + rank) * self.micro
            yield self._perm[1][start : start + self.micro].tolist()


def rank_batches(
    rows: list[dict[str, Any]], micro: int, world: int, rank: int
) -> Iterator[tuple[list[int], list[dict[str, Any]]]]:
    """This rank's share of `rows` in micro batches: micro batch j is rows [j*micro, (j+1)*micro)
    and runs on rank j % world, so which rows share a batch (hence padding and the per-batch
    token mean an eval loss is built from) does not depend on the number of ranks: a run
    resumed on another world size evaluates the same batches. Every rank yields the same
    number of batches, a rank that ran out gets ([], [rows[0]]) as a dummy: ZeRO-3's forward
    all-gathers parameters, so all ranks must run the same number of forwards."""
    total = math.ceil(len(rows) / micro)
    for b in range(math.ceil(total / world)):
        j = b * world + rank
        idx = list(range(j * micro, min((j + 1) * micro, len(rows)))) if j < total else []
        yield idx, ([rows[i] for i in idx] if idx else [rows[0]])


def padding_free_batch(
    rows: list[dict[str, Any]], pad_id: int, loss_on: str = "response", pad_to: int | None = None
) -> dict[str, torch.Tensor]:
    """SFT `rows` as one row [1, sum of lengths] (or [1, pad_to]): input ids, labels and position ids
    restarting per row, as one pack of `collate_packed`; the first token of each row is not a
    target, as in the padded batch, where nothing predicts it."""
    return collate_packed([rows], pad_id, pad_to, loss_on, flatten=True)


def dpo_padding_free_batch(
    rows: list[dict[str, Any]], pad_id: int, pad_to: int | None = None
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """DPO `rows` as one row: prompt + chosen of every row, then prompt + rejected (the padded
    batch's order, `collate`), position ids restarting per sequence, labels on the responses; and
    each token's sequence index [L] (2 x rows for the padding `pad_to` adds: the probes' worst
    case, pad_to x 2 x rows tokens). The first token of each sequence is never a target, as padded."""
    seqs = [
        {
            "input_ids": list(r["prompt_ids"]) + list(r[key]),
            "labels": [IGNORE_INDEX] * len(r["prompt_ids"]) + list(r[key]),
        }
        for key in ("chosen_ids", "rejected_ids")
        for r in rows
    ]
    batch = collate_packed([seqs], pad_id, pad_to * len(seqs) if pad_to else None, "response", flatten=True)
    segments = torch.full((batch["input_ids"].shape[1],), len(seqs), dtype=torch.long)
    start = 0
    for k, seq in enumerate(seqs):
        segments[start : start + len(seq["input_ids"])] = k
        start += len(seq["input_ids"])
    return batch, segments
