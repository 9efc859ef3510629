"""FLOPs and bytes of a traced step: torch's `FlopCounterMode` (torch/utils/flop_counter.py: matmuls,
convolutions, the CUDA attention kernels), which runs on fake tensors, with the formulas of the
ops a CPU trace runs that torch's registry lacks: SDPA's CPU flash kernel (the same count as its
CUDA twin, `sdpa_flop_count`: 4 b h s_q s_k d forward, 2.5x that backward, causal masking not
subtracted, as torch counts it) and the MoE experts' grouped matmul (`torch._grouped_mm` and
transformers' fallback op: 2 x rows x in x out). Beside the FLOPs, the attention kernels' share of
them and the bytes every kernel without FLOPs reads and writes (`_op_bytes`): the per-operation
roofline of memfit.estimate.roofline prices them at the GPU's rates and bandwidth."""

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


# ops that read or write no tensor data of their own: allocation, and _unsafe_view (a view whose
# schema does not declare the alias)
_NO_TRAFFIC = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view")
# ops that read only the rows they gather, not the whole source tensor
_GATHERS = ("embedding", "index_select", "gather")


def _is_attention(func) -> bool:
    name = func._overloadpacket.__name__
    return "attention" in name


def _op_bytes(func, args, kwargs, out) -> int:
    """Bytes a kernel reads and writes: its tensor inputs and outputs. A view (an output that
    aliases an input without writing it: view, transpose, expand, slice, detach ...) launches no
    kernel and moves nothing, nor does an op without a tensor output; an in-place op reads and
    writes its tensor; a gather reads the rows it returns (embedding, index_select, gather:
    twice its output, plus the index)."""
    import torch
    from torch.utils._pytree import tree_flatten

    schema = func._schema
    name = func._overloadpacket.__name__
    if name in _NO_TRAFFIC:
        return 0
    if schema.returns and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
        return 0
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if not outs:  # metadata (prim.device, sym sizes, .item())
        return 0
    written = sum(t.nbytes for t in outs)
    if name in _GATHERS:
        index = [
            t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and not t.is_floating_point()
        ]
        return 2 * written + sum(t.nbytes for t in index)
    read = sum(t.nbytes for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
    return read + written


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
            self.attention = 0  # FLOPs of the attention kernels (SDPA, flash, efficient, cuDNN)
            self.memory_bytes = 0  # bytes every kernel without FLOPs reads and writes (views move none)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            formula = registry.get(func._overloadpacket)
            if formula is not None:
                n = int(formula(*args, **kwargs, out_val=out))
                self.total += n
                if _is_attention(func):
                    self.attention += n
            else:
                self.memory_bytes += _op_bytes(func, args, kwargs, out)
            return out

        def get_total_flops(self) -> int:
            return self.total

        def measures(self) -> dict[str, int]:
            """FLOPs, the attention kernels' among them, and the other kernels' bytes so far."""
            return {"flops": self.total, "attn_flops": self.attention, "mem_bytes": self.memory_bytes}

    return _Counter()
