"""Whether a checkpoint continues this run, and how it loads: the content it started from
(`inputs`: model, reference and data digests, `input_changes`), the run-config fields that must
match (`MUST_MATCH`), what may differ when the number of ranks changes (`RESHARD_MAY_DIFFER`) or
after an OOM fallback (`LEVERS`), and the load mode (`SAME`, `DIRECT`, `UNIVERSAL_LOAD`) each
difference needs (`check_compatible`, `resume_mode`). Pure functions of the checkpoint's
memfit.json and the run config; memfit.train.checkpoint writes and loads the checkpoint itself."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from memfit.space import Candidate
from memfit.train.run_config import RunRefused

# Fields of the run config that must match for a checkpoint to continue the same run.
MUST_MATCH = (
    "method",
    "candidate",
    "seed",
    "lr",
    "epochs",
    "max_steps",
    "warmup_steps",
    "min_lr_ratio",
    "dpo",
    "data_dir",
    "loss_on",
    "packing",
)
# What a run starts from: compared by content (RunConfig.inputs), by path only where a side has no digests.
PATHS = ("model_path", "ref_model_path")
# Candidate fields that may differ when the number of ranks changes: gradient accumulation absorbs
# the change so that the global batch (micro x accum x ranks), hence the data order, stays the same.
RESHARD_MAY_DIFFER = ("grad_accum",)
# Candidate fields an OOM fallback (memfit.workflow.fallback) may change when it resumes a checkpoint of an
# earlier candidate of the same run (run config `fallback` > 0): levers that change memory and speed,
# not what is learned, as long as the global batch (micro x accum x ranks) stays the same. loss_impl
# full <-> chunked changes float rounding only (memfit.train.vocab_loss; per-token log-probs within 1e-6,
# tests/test_vocab_loss.py); the tiled MLP sums its tiles' weight gradients (rounding again), the
# activation offload moves tensors, not values; padding_free computes the same per-token losses
# over the same rows (within 1e-5, tests/test_padding_free.py); compile reorders float sums only
# (docs/speed.md: within 1e-3 over three steps, tests/test_compile.py); Liger's kernels compute the
# same loss and gradients up to float rounding (rtol 1e-4, tests/test_liger.py).
LEVERS = (
    "zero",
    "offload_optimizer",
    "offload_param",
    "pin_memory",
    "offload_ratio",
    "grad_ckpt",
    "micro_batch",
    "grad_accum",
    "ref",
    "loss_impl",
    "tiled_mlp",
    "activation_offload",
    "padding_free",
    "compile",
    "kernels",
)
# The levers that change how DeepSpeed lays out the optimizer state in a checkpoint (and which
# optimizer steps it: torch AdamW or DeepSpeedCPUAdam with offload): such a change loads through a
# universal checkpoint, as a change of the number of ranks does.
LAYOUT = ("zero", "offload_optimizer", "offload_param", "offload_ratio")
# How a checkpoint is loaded (resume_mode): by the ranks that wrote it, as is on another number of
# ranks (ZeRO-0: nothing is partitioned), or through a universal checkpoint (ZeRO-1/2/3).
SAME, DIRECT, UNIVERSAL_LOAD = "same", "direct", "universal"


def check_compatible(meta: dict[str, Any], run_config: dict[str, Any], where: Path, world: int | None = None) -> str:
    """How `meta`'s checkpoint continues `run_config`'s run on `world` ranks: SAME, DIRECT or
    UNIVERSAL_LOAD (see `resume_mode`). Raises ValueError naming each difference when it is
    another run's, or when the number of ranks changed in a way this run cannot follow."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if world is None else world
    then_world = int(meta["world_size"])
    then, now = meta["run_config"], run_config
    resharded = then_world != world
    levers = bool(now.get("fallback"))  # an OOM fallback: the levers may differ (memfit.workflow.fallback)
    diffs = input_changes(then, now)
    diffs += [
        f"{k}: checkpoint {then.get(k)!r} != now {now.get(k)!r}"
        for k in MUST_MATCH
        if k != "candidate" and then.get(k) != now.get(k)
    ]
    # a preference method's hyperparameters (RunConfig.pref); a checkpoint that predates them had none
    if (then.get("pref") or {}) != (now.get("pref") or {}):
        diffs.append(f"pref: checkpoint {then.get('pref') or {}!r} != now {now.get('pref') or {}!r}")
    # a field a checkpoint predates (sequence_parallel, loss_impl) had its default then
    defaults = dataclasses.asdict(Candidate())
    c_then, c_now = defaults | (then.get("candidate") or {}), defaults | (now.get("candidate") or {})
    may_differ = LEVERS if levers else RESHARD_MAY_DIFFER if resharded else ()
    diffs += [
        f"candidate.{k}: checkpoint {c_then.get(k)!r} != now {c_now.get(k)!r}"
        for k in sorted(set(c_then) | set(c_now))
        if k not in may_differ and c_then.get(k) != c_now.get(k)
    ]
    if (resharded or levers) and not diffs:
        gb_then = _global_batch(c_then, then_world)
        gb_now = _global_batch(c_now, world)
        if gb_then != gb_now:
            per_accum = world // int(c_now.get("sequence_parallel", 1)) * int(c_now.get("micro_batch", 1))
            fix = (
                f"with {world} ranks grad_accum must be {gb_then // per_accum}"
                if gb_then % per_accum == 0
                else f"no grad_accum keeps it ({gb_then} is not a multiple of micro_batch x {world} ranks)"
            )
            diffs.append(
                f"global batch: checkpoint {gb_then} (world size {then_world}) != now {gb_now} (world size "
                f"{world}); {fix} to keep the data order"
            )
    if diffs:
        note = ""
        if resharded:
            note = (
                f"\n(written by {then_world} ranks, now {world}, ZeRO-{c_then.get('zero')}: on another number "
                "of ranks only grad_accum may change, keeping the global batch)"
            )
        raise RunRefused(
            f"checkpoint {where} belongs to a different run and was not loaded:\n  "
            + "\n  ".join(diffs)
            + note
            + "\nDelete it (or the run directory) to start fresh."
        )
    if levers and any(c_then.get(k, d) != c_now.get(k, d) for k, d in _defaults().items() if k in LAYOUT):
        return layout_change_mode(c_then, c_now, where)
    if not resharded:
        return SAME
    return resume_mode(c_then, then_world, world, where)


def input_changes(then: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What the run starts from, compared by content (`inputs`, memfit.train.identity): the policy
    model, the DPO reference and the prepared data. A checkpoint that predates the digests (or a
    run started without a launcher, which records none) is compared by the model paths instead."""
    from memfit.train import identity

    then_in, now_in = then.get("inputs") or {}, now.get("inputs") or {}
    if then_in and now_in:
        return identity.changes(then_in, now_in)
    return [
        f"{k}: checkpoint {then.get(k)!r} != now {now.get(k)!r} (the checkpoint records no content digest)"
        for k in PATHS
        if k in then and k in now and then[k] != now[k]
    ]


def _defaults() -> dict[str, Any]:
    from memfit.space import Candidate

    return Candidate().to_dict()


def layout_change_mode(c_then: dict[str, Any], c_now: dict[str, Any], where: Path) -> str:
    """How a checkpoint continues under another ZeRO stage or offload (an OOM fallback), or ValueError.

    ZeRO-1/2/3 to ZeRO-1/2/3 (offload on or off): DeepSpeed's universal checkpoint holds each
    parameter's fp32 weight and Adam moments whole, whatever the stage that wrote it, and loads
    into any ZeRO stage >= 1 (https://www.deepspeed.ai/tutorials/universal-checkpointing/).
    ZeRO-0 is refused both ways: `ds_to_universal` reads only ZeRO optimizer shards
    (zero_pp_rank_*_optim_states.pt), and DeepSpeed 0.19.8's universal load assumes a ZeRO
    optimizer (engine.py `load_checkpoint` calls `optimizer.update_lp_params`, which torch's
    AdamW lacks). Loading the weights alone would restart Adam's moments: other dynamics.
    """
    z_then, z_now = int(c_then.get("zero", 2)), int(c_now.get("zero", 2))
    if z_then == 0 or z_now == 0:
        raise RunRefused(
            f"checkpoint {where} was written with ZeRO-{z_then} and cannot continue under ZeRO-{z_now}: "
            "DeepSpeed converts only ZeRO-1/2/3 optimizer shards into a universal checkpoint, and the "
            "Adam moments would restart from zero otherwise"
        )
    if z_then == 3 and z_now != 3:
        raise RunRefused(
            f"checkpoint {where} was written with ZeRO-3 and cannot continue under ZeRO-{z_now}: DeepSpeed's "
            "ZeRO-3 conversion keeps no per-parameter Adam step (ds_to_universal.py `extract_zero_shards_stage3`), "
            "so Adam's bias correction would restart"
        )
    for c, when in ((c_then, "written"), (c_now, "resumed")):
        if (
            int(c.get("zero", 2)) == 3
            and c.get("offload_optimizer", "none") != "none"
            and float(c.get("offload_ratio", 1.0)) < 1.0
        ):
            raise RunRefused(
                f"checkpoint {where} cannot change ZeRO stage or offload: {when} with ZeRO-3 partial optimizer "
                f"offload (offload_ratio {c.get('offload_ratio')}), which has no universal-checkpoint load in "
                "DeepSpeed (the device-resident optimizer state would be lost)"
            )
    return UNIVERSAL_LOAD


def _global_batch(cand: dict[str, Any], world: int) -> int:
    sp = int(cand.get("sequence_parallel", 1))  # a sequence-parallel group shares one batch
    return int(cand.get("micro_batch", 1)) * int(cand.get("grad_accum", 1)) * (world // sp)


def resume_mode(cand: dict[str, Any], then_world: int, world: int, where: Path) -> str:
    """How a checkpoint written by `then_world` ranks loads on `world` ranks, or ValueError."""
    if then_world == world:
        return SAME
    stage = int(cand.get("zero", 0))
    if stage == 0:
        # Every rank holds the whole model and optimizer state; DeepSpeed saves them in
        # mp_rank_00_model_states.pt and its plain load checks no DP world size at stage 0
        # (the check lives in `_load_zero_checkpoint`, runtime/engine.py, ZeRO only).
        return DIRECT
    if stage == 3 and cand.get("offload_optimizer", "none") != "none" and float(cand.get("offload_ratio", 1.0)) < 1.0:
        # Partial offload steps the device-resident sub-groups with a separate `backup_optimizer`
        # whose state is keyed by their fp32 partitions (DeepSpeed 0.19.8 runtime/zero/stage3.py
        # lines 313-317 and 1255-1257), while the universal loader writes every sub-group's Adam
        # state into `self.optimizer.state` (stage3.py 3681-3683,
        # `load_hp_checkpoint_state_from_checkpoint_dir_stage3`): the device part's moments would
        # silently restart from zero. Which sub-groups stay on the device also depends on the
        # number of partitions (`subgroup_to_device`, stage3.py 1099-1108).
        raise RunRefused(
            f"checkpoint {where} was written by {then_world} ranks and cannot be resumed on {world}: "
            f"ZeRO-{stage} with partial optimizer offload (offload_ratio {cand.get('offload_ratio')}) "
            "has no universal-checkpoint load in DeepSpeed (the device-resident optimizer state would be "
            f"lost). Resume on {then_world} ranks, or delete the checkpoints to start fresh."
        )
    return UNIVERSAL_LOAD
