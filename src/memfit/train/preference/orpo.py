"""ORPO: Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference Model".

Eq. 6: L = L_SFT + lambda * L_OR, with Eq. 7: L_OR = -log sigma(log odds(y_w|x) - log odds(y_l|x)),
odds(y|x) = P(y|x) / (1 - P(y|x)) (Eq. 4). As TRL 1.16 computes it (`trl/experimental/orpo/
orpo_trainer.py`, `ORPOTrainer.odds_ratio_loss`, `concatenated_forward`): log P(y|x) is the mean
of the response's token log-probs (length-averaged), log(1 - P) is `log1mexp`, lambda is TRL's
`beta`, and L_SFT is the NLL over the chosen rows' prompt and response tokens. No reference model.
Metrics under TRL's names: rewards/* (beta * mean log-prob), logps/*, nll_loss, log_odds_ratio
(log sigma of the log odds ratio) and log_odds_chosen (the log odds ratio).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from memfit.train.preference import pairs


@dataclass(frozen=True)
class ORPOConfig:
    beta: float = 0.1  # lambda of Eq. 6 (TRL ORPOConfig.beta's default)

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ValueError(f"orpo beta must be > 0, got {self.beta}")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation: Maechler 2012, "Accurately computing
    log(1 - exp(-|a|))" (log1p below -log 2, log(-expm1) above), as TRL's orpo_trainer.log1mexp."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, nll: torch.Tensor, cfg: ORPOConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair losses (their mean is TRL's loss: nll - mean(beta * log sigma(log odds ratio)))
    and per-pair metrics, from the length-averaged log-probs [B] and the batch's chosen NLL."""
    chosen, rejected = chosen.float(), rejected.float()
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    losses = nll - cfg.beta * ratio
    c, r = cfg.beta * chosen.detach(), cfg.beta * rejected.detach()
    metrics = {
        "rewards/chosen": c,
        "rewards/rejected": r,
        "rewards/accuracies": (c > r).float(),
        "rewards/margins": c - r,
        "logps/chosen": chosen.detach(),
        "logps/rejected": rejected.detach(),
        "nll_loss": nll.detach().expand_as(chosen),
        "log_odds_ratio": ratio.detach(),
        "log_odds_chosen": log_odds.detach(),
    }
    return losses, metrics


def step(runner, rows: list[dict[str, Any]], pad_to: int | None) -> tuple[torch.Tensor, dict[str, float], int]:
    """One micro batch through the policy alone (chosen and rejected in one forward)."""
    return pairs.step(runner, rows, pad_to, orpo_loss, nll_on="all")
