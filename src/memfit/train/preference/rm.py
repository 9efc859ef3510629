"""Reward-model training: the Bradley-Terry pairwise loss on a sequence-classification model.

The reward r(x, y) is the score head's output at the last non-padding token of prompt+response
(HF `*ForSequenceClassification`: the rightmost token that is not `config.pad_token_id`, as TRL's
`RewardTrainer` reads it). The loss is Ouyang et al. 2022, "Training language models to follow
instructions with human feedback", Eq. 1 (per pair): -log sigma(r(x, y_c) - r(x, y_r)), with TRL
1.16's two options (`trl/trainer/reward_trainer.py`, `RewardTrainer.compute_loss`):
- a per-pair `margin` subtracted inside the sigmoid: Touvron et al. 2023, "Llama 2", Eq. 2;
- `center_rewards_coefficient` * mean((r_c + r_r)^2): Eisenstein et al. 2023, "Helping or herding?
  Reward model ensembles mitigate but do not eliminate reward hacking", Eq. 2 (TRL's citation).
Metrics under TRL's names: `accuracy` (r_c > r_r), `margin` (r_c - r_r), `mean_reward`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from memfit.train.batches import collate, dpo_padding_free_batch


@dataclass(frozen=True)
class RMConfig:
    center_rewards_coefficient: float | None = None  # TRL RewardConfig's default: off (TRL recommends 0.01)

    def __post_init__(self) -> None:
        c = self.center_rewards_coefficient
        if c is not None and not c >= 0:
            raise ValueError(f"rm center_rewards_coefficient must be >= 0 or null, got {c}")


def rm_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, cfg: RMConfig, margin: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair losses (their mean is TRL's loss) and per-pair metrics, from the rewards [B] of the
    chosen and rejected responses; `margin` [B] (the Llama-2 margin) or None."""
    diff = chosen - rejected if margin is None else chosen - rejected - margin.to(chosen)
    losses = -F.logsigmoid(diff)
    if cfg.center_rewards_coefficient is not None:
        # mean over the batch of (r_c + r_r)^2, times the coefficient: per pair, the pair's own term
        losses = losses + cfg.center_rewards_coefficient * (chosen + rejected) ** 2
    c, r = chosen.detach(), rejected.detach()
    metrics = {
        "accuracy": (c > r).float(),  # ties are not correct, as TRL counts them
        "margin": c - r,
        "mean_reward": (c + r) / 2,  # its mean over pairs is the mean over all 2B rewards
    }
    return losses, metrics


def build_reward_model(path, pad_id: int, dtype: torch.dtype = torch.float32, **kwargs):
    """`AutoModelForSequenceClassification` with one output (the score head, newly initialised
    from the current torch seed when `path` is a causal LM, as TRL's RewardTrainer makes it) and
    `pad_token_id` set, so the reward is read at each row's last non-padding token."""
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, pad_token_id=pad_id, dtype=dtype, **kwargs
    )


def step(runner, rows: list[dict[str, Any]], pad_to: int | None) -> tuple[torch.Tensor, dict[str, float], int]:
    """One micro batch: chosen rows then rejected rows (prompt + response each) in one forward of
    the reward model; rows may carry a `margin` (all of them or none)."""
    n = len(rows)
    if runner.padding_free:
        rewards, tokens = _padding_free_rewards(runner, rows, pad_to)
    else:
        full = collate("rm", rows, runner.pad_id, pad_to)
        tokens = int(full["attention_mask"].sum())
        batch = runner._batch(full)
        out = runner.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        rewards = out.logits.squeeze(-1).float()
    margin = None
    if any(r.get("margin") is not None for r in rows):  # a prepared rm dataset: a margin or null
        if not all(r.get("margin") is not None for r in rows):
            raise ValueError("rm: some rows of the batch have a `margin` and some do not; give every row one or none")
        margin = torch.tensor([float(r["margin"]) for r in rows], device=rewards.device)
    losses, metrics = rm_loss(rewards[:n], rewards[n:], runner.pref, margin)
    sums = {"loss": float(losses.detach().sum())} | {k: float(v.sum()) for k, v in metrics.items()}
    return losses.mean(), sums, tokens


def _padding_free_rewards(runner, rows: list[dict[str, Any]], pad_to: int | None) -> tuple[torch.Tensor, int]:
    """The 2 x rows rewards [2B] of the micro batch run as one row (`padding_free`: chosen then
    rejected sequences of `memfit.train.batches.dpo_padding_free_batch`, position ids restarting per
    sequence), and its non-padding tokens. The model pools one score per row (its last non-padding
    token), so the score head's per-token output is read from a forward hook on it and taken at each
    sequence's last token: the token the padded batch's pooling reads (`build_reward_model`)."""
    flat, segments = dpo_padding_free_batch(rows, runner.pad_id, pad_to)
    n = 2 * len(rows)
    # each sequence's rightmost token that is not the pad id: where the padded batch's pooling reads
    # (transformers' *ForSequenceClassification: last_non_pad_token, from input_ids != pad_token_id)
    real = flat["input_ids"][0] != runner.pad_id
    last = [int(torch.nonzero((segments == k) & real).max()) for k in range(n)]
    batch = runner._batch(flat)
    model = getattr(runner.engine, "module", runner.engine)
    seen: list[torch.Tensor] = []
    hook = score_module(model).register_forward_hook(lambda _m, _i, out: seen.append(out))
    try:
        runner.engine(**runner.row_inputs(batch), use_cache=False)
    finally:
        hook.remove()
    per_token = seen[-1][0, :, 0]  # [T]: the head on every token of the one row
    return per_token[torch.tensor(last, device=per_token.device)].float(), int(segments.lt(n).sum())


def score_module(model) -> torch.nn.Module:
    """The score head of a transformers `*ForSequenceClassification` model (`score`; a LoRA-wrapped
    model: the same module under peft's wrapper)."""
    for name, module in model.named_modules():
        if name == "score" or name.endswith(".score"):
            return module
    raise ValueError("rm padding_free: the model has no `score` head (a transformers *ForSequenceClassification)")
