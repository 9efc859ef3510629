"""Ulysses sequence parallelism: the ranks of a group split each sequence; DeepSpeed's glue.

DeepSpeed's Arctic Long Sequence Training (Bekman et al. 2025, arXiv 2506.13996;
`deepspeed.runtime.sequence_parallel.ulysses_sp`) wraps the model's attention in
`UlyssesSPAttentionHF`: each rank of a sequence-parallel (SP) group runs the model on its slice of
the tokens, and around attention an all-to-all turns "my tokens, all heads" into "all tokens, my
heads" and back (Jacobs et al. 2023, DeepSpeed-Ulysses, arXiv 2309.14509). memfit uses that
wrapper and DeepSpeed's process groups (`parallel_state_sp`, passed to `deepspeed.initialize` as
the mpu: ZeRO partitions over every rank, gradients are summed over the SP group and averaged
over the data-parallel groups, runtime/engine.py `_reduce_non_expert_gradients`) and writes only
what a trainer owns:

- **the shard** (`shard_batch`): the batch every rank of the group drew (the same rows), its
  labels shifted for next-token prediction over the whole sequence first, then rank r keeps tokens
  [r*T/SP, (r+1)*T/SP) with their global position_ids. Ulysses drops attention masks (causal
  masking comes from the positions), which is exact for memfit's right-padded rows: a real token
  never attends to a later pad, and pads are never scored.
- **the losses**, so that the gradients DeepSpeed sums over the group are those of the whole
  sequence: SFT's token sum over this rank's tokens divided by the group's scored tokens; DPO's
  per-sequence log-probabilities summed over the group (the other ranks' parts as constants, so
  each rank back-propagates d loss/d logp through its own tokens; the same construction as
  ArcticTraining's SP loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from memfit.data import IGNORE_INDEX
from memfit.space import Candidate
from memfit.train import dist as dist_env
from memfit.train.modeling import ATTN_IMPL


@dataclass(frozen=True)
class SequenceShard:
    """This rank's place in its sequence-parallel group, and the factor its loss is scaled by so
    that the gradients DeepSpeed reduces are the whole sequences' (`loss_scale`)."""

    group: Any  # torch.distributed ProcessGroup
    rank: int
    size: int
    loss_scale: float = 1.0

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """The group's sum of a tensor (no gradient)."""
        return dist_env.all_reduce_tensor(t, "sum", self.group)

    def sum_with_own_grad(self, t: torch.Tensor) -> torch.Tensor:
        """The group's sum, differentiable through this rank's own part only."""
        return t + (self.sum(t) - t.detach())


# Why packed rows under Ulysses need FlashAttention-2: UlyssesSPAttentionHF gathers the
# position_ids of the whole sequence and drops the attention mask (ulysses_sp.py: "SP relies on
# position_ids (not attention_mask) for causal masking"); flash_attention_2 finds the rows of a
# pack from the positions (transformers modeling_flash_attention_utils, cu_seqlens), while sdpa
# without a mask is causal over the whole pack, so its rows would attend to each other.
PACKING_NEEDS_FLASH = (
    "train.sft.packing with sequence_parallel > 1 needs attn flash: DeepSpeed's Ulysses drops the "
    "attention mask, and sdpa without one would let a pack's rows attend to each other"
)


def check(cand: Candidate, world: int, packing: bool) -> None:
    """Refuse, before anything loads, what a sequence-parallel group cannot run."""
    if world % cand.sequence_parallel:
        raise ValueError(f"sequence_parallel {cand.sequence_parallel} does not divide the {world} ranks")
    if packing and cand.sequence_parallel > 1 and cand.attn != "flash":
        raise ValueError(PACKING_NEEDS_FLASH)


def setup(model, cand: Candidate, method: str):
    """(mpu for `deepspeed.initialize`, this rank's SequenceShard), or (None, None) without SP."""
    if cand.sequence_parallel == 1:
        return None, None
    forward_batch = cand.micro_batch * (2 if method == "dpo" else 1)  # DPO: chosen + rejected
    mpu = register(model, cand, forward_batch)
    return mpu, shard_of(mpu, cand.zero)


def register(model, cand: Candidate, forward_batch: int):
    """Wrap `model`'s attention in Ulysses for `cand.sequence_parallel` ranks and build the groups;
    the mpu for `deepspeed.initialize`. `forward_batch` sequences per forward (DPO: 2 x micro)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    # heads the group cannot split are refused by UlyssesSPAttentionHF itself (and by the estimator
    # before: memfit.estimate.models.validity.model_problems)
    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation=ATTN_IMPL[cand.attn],
        sequence_parallel_size=cand.sequence_parallel,
        micro_batch_size=forward_batch,
        seq_length_is_variable=True,
    )


def shard_of(mpu, zero: int) -> SequenceShard:
    """This rank's shard. DeepSpeed 0.19.8 reduces gradients over every rank (data x sequence
    parallel) but divides them differently by stage: ZeRO-0/1/2 by the data-parallel size alone,
    so a sequence-parallel group's gradients are summed (engine.py `_reduce_non_expert_gradients`,
    stage_1_and_2.py `average_tensor`: `dp_world_size / sequence_parallel_size`); ZeRO-3's
    reduce-scatter by the whole group (stage3.py `__avg_scatter_grads` ->
    comm/coalesced_collectives.py `reduce_scatter_coalesced`: `div_(world_sz)`, with no
    sequence-parallel correction), so they are averaged. At ZeRO-3 each rank's loss is therefore
    scaled by the group size (measured: tests/test_sequence_parallel.py holds the gradient norms of
    SP=2 equal to SP=1's at every stage)."""
    size = mpu.get_sequence_parallel_world_size()
    return SequenceShard(
        mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank(), size, float(size) if zero == 3 else 1.0
    )


def shard_batch(batch: dict[str, torch.Tensor], shard: SequenceShard, pad_id: int) -> dict[str, torch.Tensor]:
    """This rank's tokens of a right-padded batch: input_ids, position_ids and the labels already
    shifted (label t is the token t+1 predicts), padded to a multiple of the group size. The
    positions are the batch's own where it has them (packs: restarting at every row, so flash
    attention finds the rows of the gathered sequence; the first token of a row is never a target,
    so no row predicts the next one's), else 0..T-1."""
    ids, labels = batch["input_ids"], batch["labels"]
    b, t = ids.shape
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(t, device=ids.device).unsqueeze(0).expand(b, -1)
    total = -(-t // shard.size) * shard.size
    if total != t:  # the padding continues the last positions (a pad run of its own, never scored)
        ids = torch.cat([ids, ids.new_full((b, total - t), pad_id)], 1)
        labels = torch.cat([labels, labels.new_full((b, total - t), IGNORE_INDEX)], 1)
        positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, total - t + 1, device=ids.device)], 1)
    shifted = torch.cat([labels[:, 1:], labels.new_full((b, 1), IGNORE_INDEX)], 1)
    n = total // shard.size
    part = slice(shard.rank * n, (shard.rank + 1) * n)
    return {"input_ids": ids[:, part], "position_ids": positions[:, part], "labels": shifted[:, part]}
