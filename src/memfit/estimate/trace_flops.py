"""FLOPs of a traced step: torch's `FlopCounterMode` (torch/utils/flop_counter.py: matmuls,
convolutions, the CUDA attention kernels), which runs on fake tensors, with the formulas of the
ops a CPU trace runs that torch's registry lacks: SDPA's CPU flash kernel (the same count as its
CUDA twin, `sdpa_flop_count`: 4 b h s_q s_k d forward, 2.5x that backward, causal masking not
subtracted, as torch counts it) and the MoE experts' grouped matmul (`torch._grouped_mm` and
transformers' fallback op: 2 x rows x in x out)."""

from __future__ import annotations

from typing import Any


def _grouped_mm_flop(a_shape, b_shape, *args, **kwargs) -> int:
    # out rows x contracted x out columns, over every group: 2 * numel(a) * b.shape[-1]
    n = 1
    for d in a_shape:
        n *= d
    return 2 * n * b_shape[-1]


def _fallback_backward_flop(a_shape, b_shape, *args, **kwargs) -> int:
    return 2 * _grouped_mm_flop(a_shape, b_shape)  # grad of the input and of the weight


def _cpu_sdpa_flop(q, k, v, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(q, k, v)


def _cpu_sdpa_backward_flop(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return sdpa_backward_flop_count(grad_out, q, k, v)


def counter() -> Any:
    """A dispatch mode that sums the FLOPs of every op torch's registry (plus the formulas
    above) knows: FlopCounterMode's counting without its module hooks, which would change what
    the traced step keeps alive under checkpointing. `get_total_flops()` as FlopCounterMode."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry, shape_wrapper

    registry: dict[Any, Any] = dict(flop_registry)
    aten = torch.ops.aten
    for name, fn in (
        ("_scaled_dot_product_flash_attention_for_cpu", _cpu_sdpa_flop),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_sdpa_backward_flop),
        ("_grouped_mm", _grouped_mm_flop),
    ):
        if hasattr(aten, name):
            registry[getattr(aten, name)] = shape_wrapper(fn)
    ops = getattr(torch.ops, "transformers", None)
    for name, fn in (
        ("grouped_mm_fallback", _grouped_mm_flop),
        ("grouped_mm_fallback_backward", _fallback_backward_flop),
    ):
        try:
            registry[getattr(ops, name)] = shape_wrapper(fn)
        except (AttributeError, RuntimeError):
            pass  # transformers without the op: nothing of it runs

    class _Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            formula = registry.get(func._overloadpacket)
            if formula is not None:
                self.total += int(formula(*args, **kwargs, out_val=out))
            return out

        def get_total_flops(self) -> int:
            return self.total

    return _Counter()
