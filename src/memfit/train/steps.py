"""One micro batch's forward and loss: the same code for training, evaluation and probes."""

from __future__ import annotations

from typing import Any

import torch

from memfit.train.batches import collate, collate_packed
from memfit.train.dist import device as _device
from memfit.train.losses import DPOConfig, dpo_loss, token_logps
from memfit.train.vocab_loss import ChunkedHead


class StepRunner:
    """Forward + loss for one micro batch; the same code for training, evaluation and probes."""

    def __init__(
        self,
        method: str,
        engine,
        ref_engine,
        pad_id: int,
        *,
        dpo: dict[str, Any] | None = None,
        ref: str = "model",
        loss_on: str = "response",
        flatten_packs: bool = False,
        loss_impl: str = "full",
        loss_chunk_tokens: int | None = None,
    ) -> None:
        """`method` sft or dpo; `ref_engine` the frozen reference (None unless `ref` is "model");
        `dpo` the DPOConfig fields (DPO only); `ref` model, adapter or precomputed (Candidate.ref);
        `loss_on` response or all (SFT); `flatten_packs` packs as one [1, B*L] row (flash attention);
        `loss_impl` full (logits, then log-softmax) or chunked (memfit.train.vocab_loss: the full logits
        never exist), `loss_chunk_tokens` its chunk (None: 256 MiB of fp32 logits a chunk, vocab_loss.default_chunk_tokens)."""
        self.method, self.engine, self.ref, self.pad_id = method, engine, ref_engine, pad_id
        self.ref_mode, self.loss_on, self.flatten_packs = ref, loss_on, flatten_packs
        self.dpo = DPOConfig(**(dpo or {})) if method == "dpo" else None
        self.device = _device()
        if loss_impl not in ("full", "chunked"):
            raise ValueError(f"loss_impl must be full or chunked, got {loss_impl!r}")
        self._heads: dict[int, ChunkedHead] | None = {} if loss_impl == "chunked" else None
        self.loss_chunk_tokens = loss_chunk_tokens

    def token_logps(self, model, labels: torch.Tensor, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log p(label) [B, T-1] (fp32) and the scored mask, through `model`'s forward."""
        if self._heads is None:
            return token_logps(model(**inputs).logits, labels)
        module = getattr(model, "module", model)  # a DeepSpeed engine wraps the HF model
        head = self._heads.get(id(module))
        if head is None:
            head = self._heads[id(module)] = ChunkedHead(module, self.loss_chunk_tokens)
        with head.targets(labels):
            logps = model(**inputs).logits
        return logps, head.mask

    def _sft(self, labels: torch.Tensor, **inputs) -> torch.Tensor:
        """Mean negative log-likelihood over scored tokens (== HF's own loss with these labels)."""
        logps, mask = self.token_logps(self.engine, labels, **inputs)
        return -logps.sum() / max(int(mask.sum()), 1)

    def loss(
        self, rows: list[Any], pad_to: int | None = None, packed: bool = False
    ) -> tuple[torch.Tensor, dict[str, float], int]:
        """Mean loss over the micro batch, summed metrics (to average later) and non-padding tokens.

        packed (SFT): `rows` are packs (lists of rows), see `collate_packed`.
        """
        if packed:
            batch = {
                k: v.to(self.device)
                for k, v in collate_packed(rows, self.pad_id, pad_to, self.loss_on, self.flatten_packs).items()
            }
            loss = self._sft(
                batch["labels"], input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
            )
            return loss, {"loss": loss.item() * len(rows)}, sum(len(r["input_ids"]) for p in rows for r in p)
        batch = {k: v.to(self.device) for k, v in collate(self.method, rows, self.pad_id, pad_to, self.loss_on).items()}
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        tokens = int(batch["attention_mask"].sum())
        if self.method == "sft":
            loss = self._sft(batch["labels"], **inputs, use_cache=False)
            return loss, {"loss": loss.item() * len(rows)}, tokens
        assert self.dpo is not None
        token_lp, mask = self.token_logps(self.engine, batch["labels"], **inputs, use_cache=False)
        logps, lengths = token_lp.sum(-1), mask.sum(-1)  # log pi(y|x) summed over the response
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
                        ref_lp, _ = self.token_logps(self.engine, batch["labels"], **inputs)
                else:
                    ref_lp, _ = self.token_logps(self.ref, batch["labels"], **inputs)
                ref = ref_lp.sum(-1)
        losses, metrics = dpo_loss(logps[:n], logps[n:], ref[:n], ref[n:], self.dpo, lengths[:n], lengths[n:])
        sums = {"loss": float(losses.detach().sum())} | {k: float(v.sum()) for k, v in metrics.items()}
        return losses.mean(), sums, tokens
