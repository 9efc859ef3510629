"""Bit-exact resume for DeepSpeed's CPU Adam kernels: their bias-correction powers replayed.

DeepSpeed's C++ CPU Adam (`csrc/includes/cpu_adam.h`, `Adam_Optimizer::IncrementStep`; used by
`DeepSpeedCPUAdam` for optimizer offload and by `FusedAdam` on the CPU accelerator through
`csrc/cpu/adam/fused_adam.cpp`) keeps beta1^t and beta2^t inside a C++ object and advances them
by one float multiplication per step (`_betta1_t *= _betta1`); only a step that does not follow
the previous one is computed afresh (`std::pow(_betta1, step)`). A resumed process starts with a
new object, so its first step k+1 takes `pow`, while the uninterrupted run reached the same
power by k+1 multiplications: the two differ in the last bits of float, and so does every
update after a resume (measured on the demo: weights 7.5e-9 apart one step after resuming from
step 6; 0.9^321 is below float's resolution of 1 - x, so late resumes happened to agree).

`replay_adam_steps` calls the same kernel with empty tensors for steps 1..k before training
goes on, which advances the object exactly as the uninterrupted run did and touches no weight.
The CUDA FusedAdam computes the powers afresh every step (`csrc/adam/multi_tensor_adam.cu`) and
needs nothing.
"""

from __future__ import annotations

from typing import Any


def cpu_adam_of(engine_optimizer: Any) -> Any | None:
    """The DeepSpeed Adam that runs the C++ CPU kernel under the engine's optimizer wrappers
    (ZeRO-1/2/3, FP16/BF16 optimizers keep the base optimizer as `.optimizer`), or None."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    from memfit.train.optimizer_load import base_optimizer

    opt = base_optimizer(engine_optimizer)
    if isinstance(opt, DeepSpeedCPUAdam):
        return opt
    if isinstance(opt, FusedAdam) and get_accelerator().device_name() == "cpu":
        return opt
    return None


def saved_steps(optimizer: Any) -> int:
    """The largest step count in the optimizer state: the last step value the kernel was given
    (DeepSpeed's FusedAdam counts in one parameter's state only; ZeRO-3 subgroups each count)."""
    steps = [int(s["step"]) for s in optimizer.state.values() if "step" in s]
    return max(steps, default=0)


def replay_adam_steps(engine_optimizer: Any) -> int:
    """Advance the C++ Adam state through steps 1..k as the uninterrupted run did (k: the loaded
    state's step count); returns k, 0 where there is no CPU kernel or nothing to replay."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    opt = cpu_adam_of(engine_optimizer)
    steps = saved_steps(opt) if opt is not None else 0
    if not steps:
        return 0
    empty = torch.empty(0, dtype=torch.float32)
    with torch.no_grad():
        for step in range(1, steps + 1):
            for group in opt.param_groups:  # in the order step() visits them
                beta1, beta2 = group["betas"]
                if isinstance(opt, DeepSpeedCPUAdam):  # ops/adam/cpu_adam.py step()
                    opt.ds_opt_adam.adam_update(
                        opt.opt_id, step, group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                        group["bias_correction"], empty, empty, empty, empty,
                    )  # fmt: skip
                else:  # ops/adam/fused_adam.py step(): one kernel call per dtype list
                    opt.multi_tensor_adam(
                        2048 * 32, opt._dummy_overflow_buf, [[empty], [empty], [empty], [empty]],
                        group["lr"], beta1, beta2, group["eps"], step, opt.adam_w_mode,
                        1 if group["bias_correction"] else 0, group["weight_decay"],
                    )  # fmt: skip
    return steps
