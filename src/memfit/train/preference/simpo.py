"""SimPO: Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward".

Eq. 6: L = -log sigma(beta/|y_w| log pi(y_w|x) - beta/|y_l| log pi(y_l|x) - gamma): the implicit
reward is the length-normalised (mean over response tokens) log-prob, gamma a target margin; no
reference model. As TRL 1.16 computes it (`trl/experimental/cpo/cpo_trainer.py`, `CPOTrainer.cpo_loss`
with `loss_type="simpo"`): gamma is `simpo_gamma`, an optional cDPO-style `label_smoothing`, and
`cpo_alpha` * NLL of the chosen responses (the behaviour-cloning term of Xu et al. 2024, CPO;
TRL's "CPO-SimPO"). memfit's default cpo_alpha is 0, the paper's SimPO; TRL's CPOConfig defaults
to 1.0, so an export writes it explicitly. Metrics under TRL's names: rewards/* (beta * mean
log-prob), logps/*, nll_loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from memfit.train.preference import pairs


@dataclass(frozen=True)
class SimPOConfig:
    beta: float = 0.1  # TRL CPOConfig.beta's default (the SimPO paper tunes 2.0-10)
    simpo_gamma: float = 0.5  # gamma, the target reward margin (TRL's default)
    cpo_alpha: float = 0.0  # weight of the chosen NLL (TRL's default 1.0 is CPO-SimPO)
    label_smoothing: float = 0.0  # TRL's default

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ValueError(f"simpo beta must be > 0, got {self.beta}")
        if not self.cpo_alpha >= 0:
            raise ValueError(f"simpo cpo_alpha must be >= 0, got {self.cpo_alpha}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"simpo label_smoothing must be in [0, 0.5), got {self.label_smoothing}")


def simpo_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, nll: torch.Tensor, cfg: SimPOConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair losses (their mean is TRL's loss: mean(simpo) + cpo_alpha * nll) and per-pair
    metrics, from the length-averaged log-probs [B] and the batch's chosen-response NLL."""
    logits = (chosen - rejected) - cfg.simpo_gamma / cfg.beta  # beta * logits = Eq. 6's argument
    eps = cfg.label_smoothing
    losses = -F.logsigmoid(cfg.beta * logits) * (1 - eps) - F.logsigmoid(-cfg.beta * logits) * eps
    if cfg.cpo_alpha:
        losses = losses + cfg.cpo_alpha * nll
    c, r = cfg.beta * chosen.detach(), cfg.beta * rejected.detach()
    metrics = {
        "rewards/chosen": c,
        "rewards/rejected": r,
        "rewards/accuracies": (c > r).float(),
        "rewards/margins": c - r,
        "logps/chosen": chosen.detach(),
        "logps/rejected": rejected.detach(),
        "nll_loss": (nll.detach() if cfg.cpo_alpha else torch.zeros_like(nll)).expand_as(chosen),
    }
    return losses, metrics


def step(runner, rows: list[dict[str, Any]], pad_to: int | None) -> tuple[torch.Tensor, dict[str, float], int]:
    """One micro batch through the policy alone (chosen and rejected in one forward)."""
    return pairs.step(runner, rows, pad_to, simpo_loss, nll_on="response")
