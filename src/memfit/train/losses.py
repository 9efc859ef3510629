"""Training losses: SFT cross-entropy on response tokens and the DPO family.

DPO follows Rafailov et al. 2023, "Direct Preference Optimization", Eq. 7, with the
conventions of TRL's `DPOTrainer.dpo_loss` and OpenRLHF's `openrlhf/models/loss.py`
(`DPOLoss`): log-probabilities summed over response tokens, rewards
beta * (log pi - log pi_ref), metric names as TRL logs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from memfit.data import IGNORE_INDEX  # the one definition: the prepared labels use it


def token_logps(logits: torch.Tensor, labels: torch.Tensor, shifted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log p(label) for next-token prediction, and the mask of scored tokens.

    logits [B, T, V] predict labels shifted by one (position t predicts token t+1), as in
    HF `ForCausalLMLoss`; `shifted`: the labels already are (label t is what position t
    predicts; a sequence-parallel shard, memfit.train.sequence_parallel). Computed in fp32:
    log-softmax over a large vocabulary in bf16 loses the precision the DPO log-ratios need.
    """
    if shifted:
        logits = logits.float()
    else:
        logits, labels = logits[:, :-1, :].float(), labels[:, 1:]
    mask = labels != IGNORE_INDEX
    safe = labels.masked_fill(~mask, 0)
    logps = torch.gather(logits.log_softmax(-1), 2, safe.unsqueeze(-1)).squeeze(-1)
    return logps * mask, mask


def sft_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Mean negative log-likelihood over scored tokens (== HF's own loss with these labels).

    Returns the loss and the number of scored tokens.
    """
    logps, mask = token_logps(logits, labels)
    n = int(mask.sum())
    return -logps.sum() / max(n, 1), n


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of response-token log-probs per sequence, log pi(y|x), and the response lengths."""
    logps, mask = token_logps(logits, labels)
    return logps.sum(-1), mask.sum(-1)


@dataclass(frozen=True)
class DPOConfig:
    beta: float = 0.1  # KL-penalty strength (DPO paper's beta)
    loss_type: str = "sigmoid"  # sigmoid | ipo | hinge
    label_smoothing: float = 0.0  # cDPO: assumed probability that a preference label is flipped

    def __post_init__(self) -> None:
        if self.loss_type not in ("sigmoid", "ipo", "hinge"):
            raise ValueError(f"dpo loss_type must be sigmoid, ipo or hinge, got {self.loss_type!r}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {self.label_smoothing}")


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    cfg: DPOConfig,
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair DPO losses (mean taken by the caller) and TRL-named metrics per pair.

    Log-probs are sums over response tokens; IPO also needs the response lengths.
    """
    logits = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    if cfg.loss_type == "sigmoid":
        # DPO Eq. 7; cDPO label smoothing (Mitchell 2023, "A note on DPO with noisy preferences")
        # as OpenRLHF's DPOLoss implements it. TRL 1.16's `sigmoid` ignores label_smoothing (only
        # its `robust`/`exo_pair` use it): with label_smoothing = 0 both agree exactly
        # (tests/test_trl_parity.py).
        eps = cfg.label_smoothing
        losses = -F.logsigmoid(cfg.beta * logits) * (1 - eps) - F.logsigmoid(-cfg.beta * logits) * eps
    elif cfg.loss_type == "ipo":
        # IPO, Azar et al. 2023, Eq. 17: (h - 1/(2 tau))^2 with tau = beta, where h uses
        # log-ratios averaged over each response's tokens (TRL's `ipo`, confirmed with the authors).
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("the ipo loss needs chosen_tokens and rejected_tokens (response lengths)")
        h = (policy_chosen - ref_chosen) / chosen_tokens.clamp(min=1) - (
            policy_rejected - ref_rejected
        ) / rejected_tokens.clamp(min=1)
        losses = (h - 1 / (2 * cfg.beta)) ** 2
    else:
        # Hinge loss from SLiC (Zhao et al. 2023), as in TRL: relu(1 - beta * logits).
        losses = torch.relu(1 - cfg.beta * logits)
    chosen_rewards = cfg.beta * (policy_chosen - ref_chosen).detach()
    rejected_rewards = cfg.beta * (policy_rejected - ref_rejected).detach()
    metrics = {
        "rewards/chosen": chosen_rewards,
        "rewards/rejected": rejected_rewards,
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
        "rewards/margins": chosen_rewards - rejected_rewards,
        "logps/chosen": policy_chosen.detach(),
        "logps/rejected": policy_rejected.detach(),
    }
    return losses, metrics
