"""Optimizer state loaded in place: a resume never holds m and v twice.

DeepSpeed hands the saved state to the base optimizer's `torch.optim.Optimizer.load_state_dict`
at every ZeRO stage (runtime/zero/stage_1_and_2.py `_load_legacy_checkpoint`, stage3.py
`_rigid_load_state_dict`, runtime/fp16/fused_optimizer.py `load_state_dict`), which builds a new
state from the loaded tensors (each moved to its parameter's device,
`_process_value_according_to_param_policy`) and drops the old one only when it is complete.
In DeepSpeed 0.19.8 ZeRO-1/2/3 create Adam's state lazily, at the first step, so a resumed
process has none to duplicate; but ZeRO-0 in 16-bit wraps the optimizer in FP16_Optimizer,
whose constructor runs one step on zero gradients (`initialize_optimizer_states`) and so creates
m and v before the checkpoint loads: the load held them twice, +8 bytes per trainable parameter
on the device (measured on 2 CPU ranks, bf16 ZeRO-0 full fine-tune of the demo model: resume
83,564,804 B per rank against a training peak of 71,627,016; benchmarks/bench_resume_memory.py).

memfit keeps DeepSpeed's checkpoint format and call path and replaces only that call while a
checkpoint loads (`in_place_loading`): `load_state_dict_in_place` copies each saved tensor into
the state tensor that exists (`Tensor.copy_` converts device and dtype without a second device
buffer) and drops it from the loaded checkpoint at once; where no state exists yet it places the
loaded tensor exactly as torch would (adopted on the same device, moved once otherwise). Same
values, same dtypes and devices as torch's load: resumed runs stay bit-exact.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def base_optimizer(engine_optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer under DeepSpeed's wrappers (ZeRO-1/2/3 and the FP16/BF16 optimizers
    hold it as `.optimizer`), or None."""
    opt, seen = engine_optimizer, set()
    while opt is not None and id(opt) not in seen:
        seen.add(id(opt))
        if isinstance(opt, torch.optim.Optimizer):
            return opt
        opt = getattr(opt, "optimizer", None)
    return None


def load_state_dict_in_place(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> int:
    """What `torch.optim.Optimizer.load_state_dict` loads, copied into the existing state where
    there is one; the saved tensors leave `state_dict` as they are used. Returns how many state
    tensors were copied in place."""
    groups, saved_groups = optimizer.param_groups, state_dict["param_groups"]
    if len(groups) != len(saved_groups) or any(
        len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups, strict=True)
    ):
        raise ValueError(
            "optimizer checkpoint does not match the optimizer's parameter groups "
            f"({[len(s['params']) for s in saved_groups]} saved, {[len(g['params']) for g in groups]} now)"
        )
    by_id = {
        i: p for g, s in zip(groups, saved_groups, strict=True) for i, p in zip(s["params"], g["params"], strict=True)
    }
    saved = state_dict["state"]
    kept = {by_id[i] for i in saved}
    for p in [p for p in optimizer.state if p not in kept]:  # as torch: only the saved states remain
        del optimizer.state[p]
    in_place = 0
    for i in list(saved):
        param, values = by_id[i], saved.pop(i)
        state = optimizer.state[param]
        for key in list(values):
            value = values.pop(key)
            current = state.get(key)
            if torch.is_tensor(value) and torch.is_tensor(current) and current.shape == value.shape:
                current.copy_(value)
                in_place += 1
            elif torch.is_tensor(value):
                state[key] = torch.optim.Optimizer._process_value_according_to_param_policy(
                    param, value, i, saved_groups, key
                )
            else:
                state[key] = value
            del value
    for g, s in zip(groups, saved_groups, strict=True):
        g.update({k: v for k, v in s.items() if k != "params"})
    return in_place


@contextlib.contextmanager
def in_place_loading(engine) -> Iterator[None]:
    """While `engine.load_checkpoint` runs, the base optimizer loads its state in place.
    DeepSpeed's NVMe optimizer swapping keeps DeepSpeed's loader (its state lives in files)."""
    opt = base_optimizer(getattr(engine, "optimizer", None))
    if opt is None or getattr(engine.optimizer, "swap_optimizer", False):
        yield
        return
    opt.load_state_dict = lambda sd: load_state_dict_in_place(opt, sd)  # an instance attribute
    try:
        yield
    finally:
        opt.__dict__.pop("load_state_dict", None)  # back to the class's method
