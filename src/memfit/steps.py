"""One micro batch's forward and loss: the same code for training, evaluation and probes."""

from __future__ import annotations

from typing import Any

import torch

from memfit.batches import collate, collate_packed
from memfit.dist import device as _device
from memfit.losses import DPOConfig, dpo_loss, sequence_logps, sft_loss


class StepRunner:
    """Forward + loss for one micro batch; the same code for training, evaluation and probes."""

    def __init__(self, method: str, engine, ref_engine, pad_id: int, *, dpo: dict[str, Any] | None = None,
                 ref: str = "model", loss_on: str = "response", flatten_packs: bool = False) -> None:
        """`method` sft or dpo; `ref_engine` the frozen reference (None unless `ref` is "model");
        `dpo` the DPOConfig fields (DPO only); `ref` model, adapter or precomputed (Candidate.ref);
        `loss_on` response or all (SFT); `flatten_packs` packs as one [1, B*L] row (flash attention)."""
        self.method, self.engine, self.ref, self.pad_id = method, engine, ref_engine, pad_id
        self.ref_mode, self.loss_on, self.flatten_packs = ref, loss_on, flatten_packs
        self.dpo = DPOConfig(**(dpo or {})) if method == "dpo" else None
        self.device = _device()

    def loss(self, rows: list[Any], pad_to: int | None = None, packed: bool = False) -> tuple[torch.Tensor, dict[str, float], int]:
        """Mean loss over the micro batch, summed metrics (to average later) and non-padding tokens.

        packed (SFT): `rows` are packs (lists of rows), see `collate_packed`.
        """
        if packed:
            batch = {k: v.to(self.device) for k, v in collate_packed(rows, self.pad_id, pad_to, self.loss_on, self.flatten_packs).items()}
            out = self.engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
            loss, _ = sft_loss(out.logits, batch["labels"])
            return loss, {"loss": loss.item() * len(rows)}, sum(len(r["input_ids"]) for p in rows for r in p)
        batch = {k: v.to(self.device) for k, v in collate(self.method, rows, self.pad_id, pad_to, self.loss_on).items()}
        out = self.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        tokens = int(batch["attention_mask"].sum())
        if self.method == "sft":
            loss, _ = sft_loss(out.logits, batch["labels"])
            return loss, {"loss": loss.item() * len(rows)}, tokens
        assert self.dpo is not None
        logps, lengths = sequence_logps(out.logits, batch["labels"])
        n = len(rows)
        if self.ref_mode == "precomputed":
            ref = torch.tensor(
                [r["ref_chosen_logps"] for r in rows] + [r["ref_rejected_logps"] for r in rows],
                device=logps.device,
                dtype=logps.dtype,
            )
        else:
            with torch.no_grad():
                if self.ref_mode == "adapter":
                    with self.engine.module.disable_adapter():
                        ref_out = self.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                else:
                    ref_out = self.ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                ref, _ = sequence_logps(ref_out.logits, batch["labels"])
        losses, metrics = dpo_loss(logps[:n], logps[n:], ref[:n], ref[n:], self.dpo, lengths[:n], lengths[n:])
        sums = {"loss": float(losses.detach().sum())} | {k: float(v.sum()) for k, v in metrics.items()}
        return losses.mean(), sums, tokens
