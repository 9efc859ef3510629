"""The LoRA configuration memfit gives peft, one for the trainer and the estimator alike.

The default targets are peft's "all-linear" (every nn.Linear / Conv1D but the output head),
minus the linears peft's all-linear picks but cannot adapt, so that a model type where plain
peft raises trains (and is estimated) with LoRA on every other linear:

- the modules peft itself refuses on Mamba-type models (`out_proj`, `conv1d` of falcon_h1,
  mamba, mamba2, falcon_mamba, nemotron_h: peft/tuners/tuners_utils.py
  `_check_lora_target_modules_mamba`, asked of peft, not copied);
- nn.Linear subclasses of the model whose forward returns something other than a tensor
  (Llama-4's `Llama4Router` and PhiMoE's `PhimoeTopKRouter` return their top-k routing as a
  tuple; peft's lora.Linear adds B(A(x)) to the base layer's output and fails on it).

Explicit `targets` are passed to peft as given.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def lora_config(
    model: nn.Module,
    rank: int,
    alpha: float | None = None,
    dropout: float = 0.0,
    targets: str | Sequence[str] | None = None,
) -> Any:
    """peft's LoraConfig for `model` (alpha defaults to 2 x rank, the targets to "all-linear" less
    `unadaptable_linears(model)`)."""
    from peft import LoraConfig

    all_linear = targets in (None, "all-linear")
    return LoraConfig(
        r=rank,
        lora_alpha=alpha or 2 * rank,
        lora_dropout=dropout,
        target_modules="all-linear" if all_linear else (targets if isinstance(targets, str) else list(targets)),
        exclude_modules=(unadaptable_linears(model) or None) if all_linear else None,
        task_type="CAUSAL_LM",
    )


def unadaptable_linears(model: nn.Module) -> list[str]:
    """Full names of the linears peft's "all-linear" would pick in `model` and cannot adapt."""
    from peft import LoraConfig

    probe = LoraConfig(r=1, target_modules="all-linear")
    out = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if _peft_refuses(probe, model, name.rsplit(".", 1)[-1]) or not _returns_a_tensor(module):
            out.append(name)
    return out


def _peft_refuses(probe: Any, model: nn.Module, leaf: str) -> bool:
    try:
        from peft.tuners.tuners_utils import _check_lora_target_modules_mamba
    except ImportError:  # another peft: it raises its own error at get_peft_model
        return False
    try:
        _check_lora_target_modules_mamba(probe, model, leaf)
    except ValueError:
        return True
    return False


def _returns_a_tensor(linear: nn.Linear) -> bool:
    """Whether the module's own forward returns a tensor, run on the meta device (no memory, no
    compute; the module itself is not touched). nn.Linear's forward, and a subclass that fails
    on meta tensors, count as returning one: then peft decides."""
    if type(linear).forward is nn.Linear.forward or not type(linear).__module__.startswith("transformers."):
        return True
    twin = copy.copy(linear)
    twin._parameters = {
        k: None if v is None else torch.empty(tuple(getattr(v, "ds_shape", v.shape)), dtype=v.dtype, device="meta")
        for k, v in linear._parameters.items()
    }
    twin._forward_hooks, twin._forward_pre_hooks = {}, {}
    try:
        with torch.no_grad():
            out = twin(torch.empty(2, linear.in_features, dtype=linear.weight.dtype, device="meta"))
    except Exception:  # noqa: BLE001 - not runnable on meta: leave the module to peft
        return True
    return isinstance(out, torch.Tensor)
