"""The DeepSpeed JSON for a candidate: one builder used by probes, selection and training.

Keys and defaults follow DeepSpeed's `docs/_pages/config-json.md`; the ZeRO knobs
memfit searches over are the ones `Candidate` carries, everything else stays at
DeepSpeed's defaults unless stated here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit.space import Candidate

if TYPE_CHECKING:
    from memfit.train.run_config import RunConfig


def build(
    cand: Candidate,
    world_size: int,
    lr: float,
    total_steps: int | None,
    warmup_steps: int = 0,
    weight_decay: float = 0.0,
    grad_clip: float = 1.0,
    min_lr_ratio: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    hidden_size: int | None = None,
) -> dict[str, Any]:
    """DeepSpeed config dict: batch sizes, precision, ZeRO/offload, AdamW and a warmup-cosine LR.

    Bucket sizes follow `bucket_sizes(hidden_size)` when the hidden size is given, else
    DeepSpeed's defaults (5e8 elements: with overlap_comm ZeRO-2 allocates two such
    reduce buffers, 4 GB in fp32, whatever the model size).

    `total_steps` None (a plan without prepared data: the step count is unknown) writes
    `"auto"` for the scheduler's step counts, which the HF Trainer resolves from its
    `TrainingArguments` (transformers/integrations/deepspeed.py `trainer_config_finalize`);
    memfit's own trainer always passes numbers (`schedule_steps`).
    """
    zero: dict[str, Any] = {"stage": cand.zero}
    if cand.zero >= 1:
        # config-json.md: contiguous gradients and overlap_comm reduce fragmentation / hide comms.
        zero["contiguous_gradients"] = True
        zero["overlap_comm"] = cand.zero >= 2
        if hidden_size:
            zero.update(bucket_sizes(hidden_size, cand.zero))
    if cand.offload_optimizer != "none":
        zero["offload_optimizer"] = {
            "device": cand.offload_optimizer,
            "pin_memory": cand.pin_memory,
        }
        if cand.zero == 3 and cand.offload_ratio != 1.0:
            # ZeRO-3 partial offload ("Twin-Flow"), config-json.md `offload_optimizer.ratio`.
            zero["offload_optimizer"]["ratio"] = cand.offload_ratio
    if cand.offload_param != "none":
        zero["offload_param"] = {"device": cand.offload_param, "pin_memory": cand.pin_memory}
    if cand.zero == 3:
        # Gather full 16-bit weights on save so the exported model is loadable (config-json.md).
        zero["stage3_gather_16bit_weights_on_model_save"] = True

    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": cand.micro_batch,
        "gradient_accumulation_steps": cand.grad_accum,
        "train_batch_size": cand.global_batch(world_size),  # a sequence-parallel group shares one batch
        "gradient_clipping": grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": cand.precision == "bf16"},
        "fp16": {"enabled": cand.precision == "fp16", "initial_scale_power": 16},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "betas": list(betas), "eps": 1e-8, "weight_decay": weight_decay},
        },
        "scheduler": {
            # deepspeed/runtime/lr_schedules.py WarmupCosineLR: linear warmup, cosine decay to
            # cos_min_ratio * lr; its state is saved in DeepSpeed checkpoints.
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": "auto" if total_steps is None else max(total_steps, 1),
                # WarmupCosineLR rejects 0 warmup steps; one step starting at ratio 1.0 is none
                # (get_lr_ratio: warmup_min_ratio + step / warmup_num_steps * (1 - min_ratio)).
                "warmup_num_steps": "auto" if total_steps is None else max(warmup_steps, 1),
                "warmup_type": "linear",
                "warmup_min_ratio": 0.0 if warmup_steps else 1.0,
                "cos_min_ratio": min_lr_ratio,
            },
        },
        "steps_per_print": 10**9,  # memfit logs its own lines
        "wall_clock_breakdown": False,
    }
    if cand.offload_optimizer != "none":
        # DeepSpeedCPUAdam runs the step on the host; torch's AdamW is used otherwise.
        cfg["zero_force_ds_cpu_optimizer"] = True
    if cand.sequence_parallel > 1:  # runtime/config.py: without an mpu (zero.Init, other trainers)
        cfg["sequence_parallel_size"] = cand.sequence_parallel  # the data-parallel world is world / it
    return cfg


def bucket_sizes(hidden_size: int, stage: int) -> dict[str, int]:
    """ZeRO bucket sizes scaled to the model, as the HF Trainer resolves DeepSpeed's "auto":
    reduce_bucket_size = h*h, stage3_prefetch_bucket_size = 0.9*h*h,
    stage3_param_persistence_threshold = 10*h (transformers/integrations/deepspeed.py,
    `HfTrainerDeepSpeedConfig.trainer_config_finalize`). Elements, not bytes.
    """
    h2 = hidden_size * hidden_size
    out = {"reduce_bucket_size": h2, "allgather_bucket_size": h2}
    if stage == 3:
        out.pop("allgather_bucket_size")
        out["stage3_prefetch_bucket_size"] = int(0.9 * h2)
        out["stage3_param_persistence_threshold"] = 10 * hidden_size
    return out


# --------------------------------------------------------------------------- the step schedule
def schedule_steps(run: RunConfig, steps_per_epoch: int | None) -> tuple[int, int]:
    """(optimizer steps, warmup steps) of a run: the one definition the trainer and
    `select_config` share, so ds_config.json holds the numbers training runs with.

    Steps: `probe_steps` for a probe, else `max_steps`, else floor(epochs x steps_per_epoch)
    (at least 1), where steps_per_epoch = training units // global batch
    (`memfit.train.batches.Schedule`; the tail shorter than a global batch is skipped). Warmup is
    capped at half the run, so a short run still decays.
    """
    if run.probe_steps:
        total = run.probe_steps
    elif run.max_steps:
        total = run.max_steps
    elif steps_per_epoch is None:
        raise ValueError("schedule_steps: steps_per_epoch is needed when neither max_steps nor probe_steps is set")
    else:
        total = max(1, math.floor(run.epochs * steps_per_epoch))
    return total, _warmup(run, total)


def _warmup(run: RunConfig, total_steps: int) -> int:
    return min(run.warmup_steps, total_steps // 2)


def for_run(run: RunConfig, world_size: int, total_steps: int | None, hidden_size: int | None) -> dict[str, Any]:
    """The DeepSpeed config of `run` (what `memfit.train.loop.Run.setup` hands `deepspeed.initialize`
    on a fresh start; a universal-checkpoint resume adds `checkpoint.load_universal` there).
    `total_steps` from `schedule_steps`; None writes "auto" (see `build`)."""
    # with the step count unknown ("auto"), the configured warmup only decides warmup_min_ratio
    warmup = run.warmup_steps if total_steps is None else _warmup(run, total_steps)
    return build(
        run.cand,
        world_size,
        lr=run.lr,
        total_steps=total_steps,
        warmup_steps=warmup,
        weight_decay=run.weight_decay,
        grad_clip=run.grad_clip,
        min_lr_ratio=run.min_lr_ratio,
        hidden_size=hidden_size,
    )


def training_units(data_dir: str | Path, packing: bool, seq_len: int, seed: int) -> int:
    """How many units a training step draws from, without loading the rows: the train rows
    (stats.json `rows_kept.train`, written by `memfit.data.prepare`), or with SFT packing the
    packs `memfit.data.pack` makes of them (it reads the `length` column of train.parquet)."""
    data_dir = Path(data_dir)
    if packing:
        import pyarrow.parquet as pq

        from memfit.data import pack

        path = data_dir / "train.parquet"
        if not path.exists():
            raise FileNotFoundError(
                f"{path}: no prepared training data (needed to count the packs of the step schedule)"
            )
        lengths = pq.read_table(path, columns=["length"])["length"].to_pylist()
        if max(lengths) > seq_len:
            raise ValueError(
                f"train.sft.packing: a training row has {max(lengths)} tokens, more than the seq_len {seq_len} a pack holds"
            )
        return len(pack(lengths, seq_len, seed))
    path = data_dir / "stats.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no prepared training data (needed for the step schedule)")
    try:
        return int(json.loads(path.read_text())["rows_kept"]["train"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: no rows_kept.train ({e})") from None


def planned_steps(run: RunConfig, world_size: int) -> tuple[int | None, dict[str, Any]]:
    """The step count `select_config` writes: what the trainer will compute for `run` on
    `world_size` ranks, from the prepared data in `run.data_dir`. (None, why) when it cannot be
    known: no max_steps and no prepared data (a plan_only run)."""
    from memfit.train.batches import Schedule

    cand = run.cand
    info: dict[str, Any] = {
        "global_batch": cand.global_batch(world_size),  # a sequence-parallel group shares each batch
        "epochs": run.epochs,
        "max_steps": run.max_steps,
    }
    if run.max_steps:
        total, warmup = schedule_steps(run, None)
        return total, info | {
            "total_steps": total,
            "warmup_steps": warmup,
            "source": "train.max_steps",
        }
    try:
        units = training_units(run.data_dir, run.packing, cand.seq_len, run.seed)
    except FileNotFoundError as e:
        return None, info | {"total_steps": None, "warmup_steps": None, "source": f"unknown: {e}"}
    unit = "packed sequences (train.sft.packing)" if run.packing else "training rows"
    spe = Schedule(
        units, cand.micro_batch, cand.grad_accum, cand.data_parallel(world_size), run.seed, unit=unit
    ).steps_per_epoch
    total, warmup = schedule_steps(run, spe)
    return total, info | {
        "units": units,
        "unit": unit,
        "steps_per_epoch": spe,
        "total_steps": total,
        "warmup_steps": warmup,
        "source": f"{run.data_dir} ({units} {unit})",
    }
