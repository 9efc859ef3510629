"""The DeepSpeed JSON for a candidate: one builder used by probes, selection and training.

Keys and defaults follow DeepSpeed's `docs/_pages/config-json.md`; the ZeRO knobs
memfit searches over are the ones `Candidate` carries, everything else stays at
DeepSpeed's defaults unless stated here.
"""

from __future__ import annotations

from typing import Any

from memfit.space import Candidate


def build(
    cand: Candidate,
    world_size: int,
    lr: float,
    total_steps: int,
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
    """
    zero: dict[str, Any] = {"stage": cand.zero}
    if cand.zero >= 1:
        # config-json.md: contiguous gradients and overlap_comm reduce fragmentation / hide comms.
        zero["contiguous_gradients"] = True
        zero["overlap_comm"] = cand.zero >= 2
        if hidden_size:
            zero.update(bucket_sizes(hidden_size, cand.zero))
    if cand.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": cand.offload_optimizer, "pin_memory": cand.pin_memory}
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
        "train_batch_size": cand.micro_batch * cand.grad_accum * world_size,
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
                "total_num_steps": max(total_steps, 1),
                # WarmupCosineLR rejects 0 warmup steps; one step starting at ratio 1.0 is none
                # (get_lr_ratio: warmup_min_ratio + step / warmup_num_steps * (1 - min_ratio)).
                "warmup_num_steps": max(warmup_steps, 1),
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
