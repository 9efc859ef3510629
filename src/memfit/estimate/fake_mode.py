"""What a step on fake tensors needs from transformers (shared by the trace, memfit.estimate.
trace_step, and the inventory's gradient check, memfit.estimate.inventory)."""

from __future__ import annotations


def grouped_mm_for_fake(fake: bool):
    """transformers' MoE experts call torch._grouped_mm, whose fake (meta) kernel accepts bf16
    only, while the CPU kernel also runs fp16/fp32 (torch 2.13). On fake tensors of another
    dtype the experts take transformers' own fallback op (integrations/moe.py
    `_grouped_mm_fallback`, a custom op with a registered fake and the same saved tensors: the
    input and the weight), as transformers does under torch.compile for non-bf16 dtypes."""
    import contextlib
    from unittest import mock

    import torch

    try:
        from transformers.integrations import moe
    except ImportError:
        return contextlib.nullcontext()
    if not fake or not hasattr(moe, "_can_use_grouped_mm"):
        return contextlib.nullcontext()
    real = moe._can_use_grouped_mm
    return mock.patch.object(moe, "_can_use_grouped_mm", lambda i, w, o: w.dtype == torch.bfloat16 and real(i, w, o))
