"""One micro batch's forward and loss: the same code for training, evaluation and probes."""

from __future__ import annotations

from typing import Any

import torch

from memfit.methods import PADDING_FREE_METHODS
from memfit.train import preference
from memfit.train.batches import collate, collate_packed, dpo_padding_free_batch, padding_free_batch
from memfit.train.dist import device as _device
from memfit.train.losses import DPOConfig, dpo_loss, token_logps
from memfit.train.sequence_parallel import SequenceShard, shard_batch
from memfit.train.varlen_attention import seq_lens_kwargs
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
        shard: SequenceShard | None = None,
        pref: dict[str, Any] | None = None,
        padding_free: bool = False,
    ) -> None:
        """`method` sft or dpo; `ref_engine` the frozen reference (None unless `ref` is "model");
        `dpo` the DPOConfig fields (DPO only); `ref` model, adapter or precomputed (Candidate.ref);
        `loss_on` response or all (SFT); `flatten_packs` packs as one [1, B*L] row (flash attention);
        `loss_impl` full (logits, then log-softmax), chunked (memfit.train.vocab_loss: the full logits
        never exist) or liger (`kernels: liger`, memfit.train.liger: Liger's fused linear cross-entropy), `loss_chunk_tokens` its chunk (None: 256 MiB of fp32 logits a chunk, vocab_loss.default_chunk_tokens);
        `shard` this rank's place in a sequence-parallel group (memfit.train.sequence_parallel): it
        runs its slice of every sequence, and the losses are the whole sequences'.
        rm, orpo, simpo, kto (memfit.train.preference): `pref` their TRL-named hyperparameters; rm's
        `engine` a sequence-classification model; kto's `ref_engine` as DPO's.
        `padding_free` (PADDING_FREE_METHODS): each micro batch runs as one row, its sequences concatenated with
        position ids restarting at every sequence (`padding_free_batch`, `dpo_padding_free_batch`),
        so no padding is computed."""
        self.method, self.engine, self.ref, self.pad_id = method, engine, ref_engine, pad_id
        self.ref_mode, self.loss_on, self.flatten_packs = ref, loss_on, flatten_packs
        self.dpo = DPOConfig(**(dpo or {})) if method == "dpo" else None
        self.pref = preference.make_config(method, pref) if method in preference.METHODS else None
        self.device = _device()
        if loss_impl not in ("full", "chunked", "liger"):
            raise ValueError(f"loss_impl must be full, chunked or liger, got {loss_impl!r}")
        self._heads: dict[int, Any] | None = {} if loss_impl != "full" else None
        self._head_cls: Any = ChunkedHead
        if loss_impl == "liger":
            from memfit.train.liger import LigerHead

            self._head_cls = LigerHead
        self.loss_chunk_tokens = loss_chunk_tokens
        self.shard = shard if shard is not None and shard.size > 1 else None
        if padding_free and method not in PADDING_FREE_METHODS:
            raise ValueError(f"padding_free applies to {', '.join(PADDING_FREE_METHODS)} only, not {method}")
        self.padding_free = padding_free

    def token_logps(self, model, labels: torch.Tensor, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log p(label) [B, T-1] (fp32) and the scored mask, through `model`'s forward
        (a sequence-parallel shard: [B, T/SP], its labels already shifted)."""
        shifted = self.shard is not None
        if self._heads is None:
            return token_logps(model(**inputs).logits, labels, shifted)
        module = getattr(model, "module", model)  # a DeepSpeed engine wraps the HF model
        head = self._heads.get(id(module))
        if head is None:
            head = self._heads[id(module)] = self._head_cls(module, self.loss_chunk_tokens)
        with head.targets(labels, shifted):
            logps = model(**inputs).logits
        return logps, head.mask

    def _sft(self, labels: torch.Tensor, **inputs) -> tuple[torch.Tensor, float]:
        """Mean negative log-likelihood over scored tokens (== HF's own loss with these labels),
        and its value. In a sequence-parallel group: this rank's tokens over the group's count
        (DeepSpeed sums the group's gradients), the value the whole sequences' mean."""
        logps, mask = self.token_logps(self.engine, labels, **inputs)
        if self.shard is None:
            loss = -logps.sum() / max(int(mask.sum()), 1)
            return loss, loss.item()
        scored = max(int(self.shard.sum(mask.sum())), 1)
        loss = -logps.sum() / scored
        return loss * self.shard.loss_scale, float(self.shard.sum(loss))

    def _rank_tokens(self, tokens: int) -> int:
        """This rank's share of the sequences' own tokens, for its tokens/s (all of them without SP)."""
        return tokens if self.shard is None else -(-tokens // self.shard.size)

    def _batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's inputs and labels on this rank's device: the batch, or its sequence shard."""
        if self.shard is not None:
            batch = shard_batch(batch, self.shard, self.pad_id)
        return {k: v.to(self.device) for k, v in batch.items()}

    @staticmethod
    def row_inputs(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The model's inputs for a padding-free row (on its device): input and position ids, and the
        sequences the position ids start (`varlen_attention.seq_lens_kwargs`: flash-attention's
        varlen arguments, which memfit's per-sequence sdpa reads too; eager ignores them)."""
        positions = batch["position_ids"]
        return {"input_ids": batch["input_ids"], "position_ids": positions, **seq_lens_kwargs(positions)}

    def _padding_free(
        self, rows: list[Any], pad_to: int | None, packed: bool
    ) -> tuple[torch.Tensor, dict[str, float], int]:
        """SFT on the micro batch as one row: its rows (with packing: every row of its packs)
        concatenated, position ids restarting at 0 at each row, no attention mask, and the rows'
        cu_seq_lens (`row_inputs`): each row attends over itself (flash-attention varlen, memfit's
        per-sequence sdpa; eager masks block-causally, `collate_packed`). The loss is the per-token mean over the same tokens as the padded batch.
        `pad_to` (probes): the row is padded to pad_to x rows, the padded batch's worst case."""
        flat = [r for p in rows for r in p] if packed else list(rows)
        batch = padding_free_batch(flat, self.pad_id, self.loss_on, pad_to * len(rows) if pad_to else None)
        batch = self._batch(batch)
        loss, value = self._sft(batch["labels"], **self.row_inputs(batch), use_cache=False)
        return loss, {"loss": value * len(rows)}, sum(len(r["input_ids"]) for r in flat)

    def loss(
        self, rows: list[Any], pad_to: int | None = None, packed: bool = False
    ) -> tuple[torch.Tensor, dict[str, float], int]:
        """Mean loss over the micro batch, summed metrics (to average later) and non-padding tokens.

        packed (SFT): `rows` are packs (lists of rows), see `collate_packed`.
        """
        if self.padding_free and self.method == "sft":
            return self._padding_free(rows, pad_to, packed)
        if self.padding_free and self.method == "dpo":  # the 2 x rows sequences as one row
            flat, segments = dpo_padding_free_batch(rows, self.pad_id, pad_to)
            tokens = int(segments.lt(2 * len(rows)).sum())
            batch = self._batch(flat)
            inputs = self.row_inputs(batch)
            return self._dpo(rows, batch["labels"], inputs, tokens, segments.to(self.device))
        if packed:  # under sequence parallelism: the pack's shard (flash attention only: sequence_parallel.check)
            batch = self._batch(collate_packed(rows, self.pad_id, pad_to, self.loss_on, self.flatten_packs))
            loss, value = self._sft(
                batch["labels"], input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
            )
            return (
                loss,
                {"loss": value * len(rows)},
                self._rank_tokens(sum(len(r["input_ids"]) for p in rows for r in p)),
            )
        if self.pref is not None:
            return preference.step(self, rows, pad_to)
        full = collate(self.method, rows, self.pad_id, pad_to, self.loss_on)
        tokens = self._rank_tokens(int(full["attention_mask"].sum()))
        batch = self._batch(full)
        if self.shard is None:
            inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        else:  # Ulysses masks causally from the positions (right padding: exact)
            inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
        if self.method == "sft":
            loss, value = self._sft(batch["labels"], **inputs, use_cache=False)
            return loss, {"loss": value * len(rows)}, tokens
        return self._dpo(rows, batch["labels"], inputs, tokens)

    def _dpo(
        self,
        rows: list[Any],
        labels: torch.Tensor,
        inputs: dict[str, torch.Tensor],
        tokens: int,
        segments: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float], int]:
        """DPO on [chosen rows; rejected rows]: padded [2n, L] (`segments` None), or one row of
        their tokens whose `segments` say which sequence each token belongs to (2n: padding)."""
        assert self.dpo is not None
        n = len(rows)

        def per_sequence(token_lp: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """log pi(y|x) summed over each sequence's response tokens, and the response lengths."""
            if segments is None:
                return token_lp.sum(-1), mask.sum(-1)
            # position t scores token t + 1 (token_logps shifts): the sequence of the token scored
            seg = segments[1:]
            sums = token_lp.new_zeros(2 * n + 1).index_add(0, seg, token_lp[0])
            lengths = mask.new_zeros(2 * n + 1, dtype=torch.long).index_add(0, seg, mask[0].long())
            return sums[: 2 * n], lengths[: 2 * n]

        logps, lengths = per_sequence(*self.token_logps(self.engine, labels, **inputs, use_cache=False))
        if self.shard is not None:  # the whole sequences' sums; gradients through this rank's tokens
            logps, lengths = self.shard.sum_with_own_grad(logps), self.shard.sum(lengths)
        if self.ref_mode == "precomputed":
            ref = torch.tensor(
                [r["ref_chosen_logps"] for r in rows] + [r["ref_rejected_logps"] for r in rows],
                device=logps.device,
                dtype=logps.dtype,
            )
        else:
            with torch.no_grad():
                if self.ref_mode == "adapter":
                    with getattr(self.engine, "module", self.engine).disable_adapter():
                        ref_lp = per_sequence(*self.token_logps(self.engine, labels, **inputs))[0]
                else:
                    ref_lp = per_sequence(*self.token_logps(self.ref, labels, **inputs))[0]
                ref = ref_lp if self.shard is None else self.shard.sum(ref_lp)
        losses, metrics = dpo_loss(logps[:n], logps[n:], ref[:n], ref[n:], self.dpo, lengths[:n], lengths[n:])
        sums = {"loss": float(losses.detach().sum())} | {k: float(v.sum()) for k, v in metrics.items()}
        scale = self.shard.loss_scale if self.shard is not None else 1.0
        return losses.mean() * scale, sums, tokens
