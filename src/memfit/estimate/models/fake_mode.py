"""What a step on fake tensors needs from transformers (shared by the trace, memfit.estimate.
trace_step, and the inventory's gradient check, memfit.estimate.models.inventory)."""

from __future__ import annotations

import functools


def grouped_mm_for_fake(fake: bool):
    """transformers' MoE experts call torch._grouped_mm, whose fake (meta) kernel accepts bf16
    only, while the CPU kernel also runs fp16/fp32 (torch 2.13). On fake tensors of another
    dtype the experts' grouped matmul runs `_fake_grouped_mm()`: torch._grouped_mm's autograd, with
    transformers' own fallback op (integrations/moe.py `_grouped_mm_fallback`, which has a
    registered fake) doing the arithmetic."""
    import contextlib
    from unittest import mock

    import torch

    try:
        from transformers.integrations import moe
    except ImportError:
        return contextlib.nullcontext()
    if not fake or not hasattr(moe, "_grouped_mm") or not hasattr(torch.ops.transformers, "grouped_mm_fallback"):
        return contextlib.nullcontext()
    real = moe._grouped_mm

    def grouped_mm(input, weight, offs):
        if weight.dtype == torch.bfloat16:
            return real(input, weight, offs)
        return _fake_grouped_mm().apply(input.to(weight.dtype), weight, offs)

    return mock.patch.object(moe, "_grouped_mm", grouped_mm)


@functools.cache
def _fake_grouped_mm():
    """torch._grouped_mm's autograd (tools/autograd/derivatives.yaml: the input's gradient is
    grad @ weight^T, the weight's is input^T @ grad; autograd's generated code saves the input
    only when the weight needs a gradient, so frozen experts under LoRA keep no copy of their
    input, and it computes only the gradients needed). transformers' fallback op saves both and
    allocates both gradients, which put every frozen MoE layer's input and a full expert-weight
    gradient into LoRA traces (+6 to +11% on tiny MoE models, docs/coverage.md)."""
    import torch

    class FakeGroupedMM(torch.autograd.Function):
        @staticmethod
        def forward(ctx, input, weight, offs):
            # the weight is kept whenever a gradient is needed: a parameter (or peft's W + BA,
            # which its own autograd keeps); torch saves it only for the input's gradient, and
            # an input that needs none beside a weight that does is not a step memfit traces
            ctx.save_for_backward(weight, input if ctx.needs_input_grad[1] else None, offs)
            return torch.ops.transformers.grouped_mm_fallback(input, weight, offs)

        @staticmethod
        def backward(ctx, grad):
            weight, input, offs = ctx.saved_tensors
            if ctx.needs_input_grad[1]:  # the backward op computes both gradients
                grad_input, grad_weight = torch.ops.transformers.grouped_mm_fallback_backward(input, weight, offs, grad)
                return (grad_input if ctx.needs_input_grad[0] else None), grad_weight, None
            grad_input = torch.ops.transformers.grouped_mm_fallback(grad, weight.transpose(1, 2), offs)
            return grad_input, None, None

    return FakeGroupedMM
