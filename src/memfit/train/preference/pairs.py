"""The policy-only pair forward ORPO and SimPO share: chosen and rejected in one forward (no
reference model), length-averaged response log-probs and a chosen-row NLL, as TRL 1.16's
`ORPOTrainer.concatenated_forward` / `CPOTrainer.concatenated_forward` compute them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from memfit.train.batches import collate, dpo_padding_free_batch
from memfit.train.losses import IGNORE_INDEX


@dataclass
class PairLogps:
    chosen: torch.Tensor  # [B] mean log p over each chosen response's tokens
    rejected: torch.Tensor  # [B]
    nll: torch.Tensor  # scalar: mean NLL over the chosen rows' scored tokens (see `forward`)
    tokens: int  # non-padding tokens of the micro batch


def forward(runner, rows: list[dict[str, Any]], pad_to: int | None, nll_on: str) -> PairLogps:
    """One forward of chosen rows then rejected rows through the policy.

    `nll_on`: "all" scores every non-padding token of the chosen rows, prompt included (TRL's
    ORPO: "orpo chosen nll loss is computed over the full prompt and response"); "response" the
    chosen responses only (TRL's CPO/SimPO `cpo_alpha` term). The NLL is a token mean over the
    micro batch's chosen rows (torch CrossEntropyLoss's mean, as TRL takes it).
    """
    if nll_on not in ("all", "response"):
        raise ValueError(f"nll_on must be all or response, got {nll_on!r}")
    if runner.padding_free:
        return _forward_padding_free(runner, rows, pad_to, nll_on)
    full = collate("dpo", rows, runner.pad_id, pad_to)  # chosen rows then rejected rows, right padding
    tokens = int(full["attention_mask"].sum())
    batch = runner._batch(full)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}
    response = batch["labels"]
    # one pass over the vocabulary for both terms: score every real token, then pick the responses
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX) if nll_on == "all" else response
    token_lp, scored = runner.token_logps(runner.engine, labels, **inputs)
    in_response = response[:, 1:] != IGNORE_INDEX  # position t predicts token t+1
    lengths = in_response.sum(-1)
    mean_lp = (token_lp * in_response).sum(-1) / lengths.clamp(min=1)
    n = len(rows)
    nll = -(token_lp[:n] * scored[:n]).sum() / scored[:n].sum().clamp(min=1)
    return PairLogps(mean_lp[:n], mean_lp[n:], nll, tokens)


def _forward_padding_free(runner, rows: list[dict[str, Any]], pad_to: int | None, nll_on: str) -> PairLogps:
    """`forward` on the micro batch as one row (`padding_free`): the 2 x rows sequences of
    `memfit.train.batches.dpo_padding_free_batch` (chosen then rejected, position ids restarting per
    sequence), each sequence's sums taken by its segment. The same tokens are scored as in the padded
    batch: the first token of a sequence never (nothing before it in its own sequence predicts it)."""
    n = len(rows)
    flat, segments = dpo_padding_free_batch(rows, runner.pad_id, pad_to)
    tokens = int(segments.lt(2 * n).sum())
    batch = runner._batch(flat)
    segments = segments.to(batch["input_ids"].device)
    response = batch["labels"]
    labels = response
    if nll_on == "all":  # every token of its own sequence but the first; padding (segment 2n) never
        first = batch["position_ids"] == 0
        labels = batch["input_ids"].masked_fill(first | (segments == 2 * n).unsqueeze(0), IGNORE_INDEX)
    token_lp, scored = runner.token_logps(runner.engine, labels, **runner.row_inputs(batch), use_cache=False)
    seg = segments[1:]  # position t scores token t + 1: the sequence of the token scored
    in_response = response[0, 1:] != IGNORE_INDEX
    sums = token_lp.new_zeros(2 * n + 1).index_add(0, seg, token_lp[0] * in_response)
    lengths = token_lp.new_zeros(2 * n + 1).index_add(0, seg, in_response.to(token_lp.dtype))
    mean_lp = sums[: 2 * n] / lengths[: 2 * n].clamp(min=1)
    chosen = scored[0] & seg.lt(n)
    nll = -(token_lp[0] * chosen).sum() / chosen.sum().clamp(min=1)
    return PairLogps(mean_lp[:n], mean_lp[n:], nll, tokens)


def step(
    runner, rows: list[dict[str, Any]], pad_to: int | None, loss_fn, nll_on: str
) -> tuple[torch.Tensor, dict[str, float], int]:
    """One micro batch through the policy alone (chosen and rejected in one forward), scored by
    `loss_fn(chosen, rejected, nll, cfg) -> (per-pair losses, per-pair metrics)`: ORPO's and SimPO's step."""
    lp = forward(runner, rows, pad_to, nll_on=nll_on)
    losses, metrics = loss_fn(lp.chosen, lp.rejected, lp.nll, runner.pref)
    sums = {"loss": float(losses.detach().sum())} | {k: float(v.sum()) for k, v in metrics.items()}
    return losses.mean(), sums, lp.tokens
