"""KTO: Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization".

Eq. 8: L = E[lambda_y - v(x, y)], with r = log pi(y|x) - log pi_ref(y|x) (summed over the
response), the reference point z0 = KL(pi || pi_ref) and
v = lambda_D * sigma(beta * (r - z0)) for a desirable y, lambda_U * sigma(beta * (z0 - r)) for an
undesirable one. As TRL 1.16 computes it (`trl/trainer/kto_trainer.py`, `KTOTrainer._compute_loss`,
loss_type "kto"): per row lambda_y * (1 - sigma(...)), the mean over the micro batch's rows;
lambda_D, lambda_U are `desirable_weight`, `undesirable_weight`; z0 is estimated from a mismatched
KL batch (each prompt with another row's completion: TRL rotates the completions by one within
the batch, (x_1, y_n), (x_2, y_1), ...), as mean(log pi - log pi_ref) over it, computed without
gradient, averaged over the data-parallel ranks (TRL's gather), clamped at 0 and detached.

Rows: `prompt_ids`, `completion_ids`, `label` (true: desirable). A row may carry its own KL
completion, `kl_completion_ids` (a fixed pairing: needed to precompute the reference's KL
log-probs, `ref_logps` and `ref_KL_logps` on the rows); without it the batch's rotation is used.
Metrics under TRL's names: `kl`, rewards/chosen and logps/chosen over the desirable rows,
rewards/rejected and logps/rejected over the undesirable ones, rewards/margins.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from memfit.train import dist as dist_env
from memfit.train.batches import _pad
from memfit.train.losses import IGNORE_INDEX


@dataclass(frozen=True)
class KTOConfig:
    beta: float = 0.1  # TRL KTOConfig's defaults
    desirable_weight: float = 1.0  # lambda_D
    undesirable_weight: float = 1.0  # lambda_U

    def __post_init__(self) -> None:
        for key in ("beta", "desirable_weight", "undesirable_weight"):
            if not getattr(self, key) > 0:
                raise ValueError(f"kto {key} must be > 0, got {getattr(self, key)}")


def kto_loss(
    policy: torch.Tensor,
    ref: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
    cfg: KTOConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-row losses [B] (their mean is TRL's loss) and per-row metrics; `policy`/`ref` the summed
    response log-probs [B], `desirable` [B] bool, `kl` the reference point z0 (see `reference_point`)."""
    logratios = policy - ref
    chosen = cfg.desirable_weight * (1 - F.sigmoid(cfg.beta * (logratios - kl)))
    rejected = cfg.undesirable_weight * (1 - F.sigmoid(cfg.beta * (kl - logratios)))
    losses = torch.where(desirable, chosen, rejected)
    rewards = cfg.beta * logratios.detach()
    d, u = desirable.float(), (~desirable).float()
    metrics = {  # sums over each kind of row: `finish_metrics` divides them by the kind's count
        "rewards/chosen_sum": rewards * d,
        "rewards/rejected_sum": rewards * u,
        "logps/chosen_sum": policy.detach() * d,
        "logps/rejected_sum": policy.detach() * u,
        "count/desirable": d,
        "count/undesirable": u,
        "kl": kl.detach().expand_as(policy),
    }
    return losses, metrics


def reference_point(kl_policy: torch.Tensor, kl_ref: torch.Tensor) -> torch.Tensor:
    """z0: mean(log pi - log pi_ref) over the KL batch, averaged over the data-parallel ranks,
    clamped at 0, detached (TRL: `(KL_logps - ref_KL_logps).mean().detach()`, gathered, `.clamp(min=0)`)."""
    kl = (kl_policy - kl_ref).mean().detach()
    if dist_env.initialized():
        kl = torch.tensor(dist_env.all_reduce([float(kl)])[0] / dist_env.world(), dtype=kl.dtype, device=kl.device)
    return kl.clamp(min=0)


def finish_metrics(means: dict[str, float]) -> dict[str, float]:
    """TRL's metrics from the row means of `kto_loss`'s sums (the loop divides every sum by the rows):
    rewards/chosen = mean reward over the desirable rows, and so on; margins when both kinds occur."""
    out = {k: v for k, v in means.items() if not k.endswith("_sum") and not k.startswith("count/")}
    for kind, count in (("chosen", "count/desirable"), ("rejected", "count/undesirable")):
        if means.get(count, 0.0) > 0:
            for what in ("rewards", "logps"):
                out[f"{what}/{kind}"] = means[f"{what}/{kind}_sum"] / means[count]
    if "rewards/chosen" in out and "rewards/rejected" in out:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out


def kl_completions(rows: list[dict[str, Any]]) -> list[list[int]]:
    """Each row's mismatched completion: its own `kl_completion_ids`, else the previous row's
    completion within the batch (the first row takes the last one's), as TRL pairs them."""
    if all("kl_completion_ids" in r for r in rows):
        return [list(r["kl_completion_ids"]) for r in rows]
    if any("kl_completion_ids" in r for r in rows):
        raise ValueError(
            "kto: some rows of the batch have kl_completion_ids and some do not; give every row one or none"
        )
    completions = [list(r["completion_ids"]) for r in rows]
    return completions[-1:] + completions[:-1]


def collate(rows: list[dict[str, Any]], pad_id: int, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """Right-padded rows (prompt + completion, labels on the completion) and the KL batch
    (`kl_` keys: each prompt with its mismatched completion, truncated to `pad_to` as TRL's
    collator truncates to max_length)."""
    out: dict[str, torch.Tensor] = {}
    for prefix, completions in (("", [r["completion_ids"] for r in rows]), ("kl_", kl_completions(rows))):
        ids, labels = [], []
        for r, c in zip(rows, completions, strict=True):
            p = list(r["prompt_ids"])
            ids.append(p + list(c))
            labels.append([IGNORE_INDEX] * len(p) + list(c))
        out[f"{prefix}input_ids"] = _pad(ids, pad_id, pad_to)
        out[f"{prefix}labels"] = _pad(labels, IGNORE_INDEX, pad_to)
        out[f"{prefix}attention_mask"] = _pad([[1] * len(s) for s in ids], 0, pad_to)
    return out


def _labels(rows: list[dict[str, Any]]) -> torch.Tensor:
    bad = [r.get("label") for r in rows if r.get("label") not in (True, False, 0, 1)]
    if bad:
        raise ValueError(f"kto: a row's label must be true (desirable) or false (undesirable), got {bad[0]!r}")
    return torch.tensor([bool(r["label"]) for r in rows])


def _sequence_logps(runner, model, batch: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    lp, _ = runner.token_logps(
        model,
        batch[f"{prefix}labels"],
        input_ids=batch[f"{prefix}input_ids"],
        attention_mask=batch[f"{prefix}attention_mask"],
        use_cache=False,
    )
    return lp.sum(-1)


def _reference_logps(runner, rows, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's summed log-probs on the rows and on the KL batch."""
    if runner.ref_mode == "precomputed":
        if not all("kl_completion_ids" in r and "ref_logps" in r and "ref_KL_logps" in r for r in rows):
            raise ValueError(
                "kto with ref: precomputed needs rows with kl_completion_ids, ref_logps and ref_KL_logps "
                "(the reference's log-probs of a fixed KL pairing); use ref: model or adapter otherwise"
            )
        device = batch["input_ids"].device
        return (
            torch.tensor([float(r["ref_logps"]) for r in rows], device=device),
            torch.tensor([float(r["ref_KL_logps"]) for r in rows], device=device),
        )
    adapter = runner.ref_mode == "adapter"
    model = runner.engine if adapter else runner.ref
    with torch.no_grad(), runner.engine.module.disable_adapter() if adapter else nullcontext():
        return _sequence_logps(runner, model, batch, ""), _sequence_logps(runner, model, batch, "kl_")


def step(runner, rows: list[dict[str, Any]], pad_to: int | None) -> tuple[torch.Tensor, dict[str, float], int]:
    """One micro batch: the policy on the rows (with gradient) and on the KL batch (without), the
    reference on both."""
    desirable = _labels(rows)
    full = collate(rows, runner.pad_id, pad_to)
    tokens = int(full["attention_mask"].sum())
    batch = runner._batch(full)
    policy = _sequence_logps(runner, runner.engine, batch, "")
    with torch.no_grad():
        kl_policy = _sequence_logps(runner, runner.engine, batch, "kl_")
    ref, kl_ref = _reference_logps(runner, rows, batch)
    kl = reference_point(kl_policy, kl_ref.to(kl_policy))
    losses, metrics = kto_loss(policy, ref.to(policy), desirable.to(policy.device), kl, runner.pref)
    sums = {"loss": float(losses.detach().sum())} | {k: float(v.sum()) for k, v in metrics.items()}
    return losses.mean(), sums, tokens
