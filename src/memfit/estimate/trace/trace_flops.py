"""FLOPs and bytes of a traced step: torch's `FlopCounterMode` registry (torch/utils/flop_counter.py)
for the matmuls and convolutions, which runs on fake tensors, and memfit's own formulas for what
it must not depend on the installed torch for or what the registry lacks:
  - every attention kernel (SDPA's CPU flash kernel, the CUDA flash, memory-efficient and cuDNN
    kernels, their packed-sequence and varlen forms, forward and backward: `attention_formulas`),
    counted as torch 2.13 counts them (`sdpa_flop_count`, `sdpa_backward_flop_count`): the
    forward's two matmuls, 2 b h_q s_q s_k (d_q + d_v), the backward's five (the scores
    recomputed), 2 b h_q s_q s_k (3 d_q + 2 d_v), grouped-query k/v broadcast to the query's
    heads, masks and dropout adding nothing, causal masking not subtracted. Not torch's own
    functions: they differ between versions (PyTorch 2.11's `sdpa_flop_count` refuses k/v with
    fewer heads than the query, failing the trace of every GQA model), and 2.13's read the dense
    (b, s, h, d) tensors of `_flash_attention_forward`/`_efficient_attention_forward` as
    (b, h, s, d) (pytorch/pytorch#178064);
  - the MoE experts' grouped matmul (`torch._grouped_mm` and transformers' fallback op:
    2 x rows x in x out).
Beside the FLOPs, the attention kernels' share of them and the bytes every kernel without FLOPs
reads and writes (`_op_bytes`): the per-operation roofline of memfit.estimate.time.roofline prices
them at the GPU's rates and bandwidth."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def _grouped_mm_flop(a_shape, b_shape, *args, **kwargs) -> int:
    # out rows x contracted x out columns, over every group: 2 * numel(a) * b.shape[-1]
    n = 1
    for d in a_shape:
        n *= d
    return 2 * n * b_shape[-1]


def _fallback_backward_flop(a_shape, b_shape, *args, **kwargs) -> int:
    return 2 * _grouped_mm_flop(a_shape, b_shape)  # grad of the input and of the weight


def _attention_flops(q: Sequence[int], k: Sequence[int], v: Sequence[int], backward: bool) -> int:
    """One attention's FLOPs from q (b, h_q, s_q, d_q), k (b, h_kv, s_k, d_q), v (b, h_kv, s_k, d_v).

    As torch/utils/flop_counter.py of PyTorch 2.13 (`sdpa_flop_count`, `sdpa_backward_flop_count`)
    and FlashAttention-2 (Dao 2023) count them: the forward is q k^T and p v, 2 b h_q s_q s_k
    (d_q + d_v); the backward recomputes q k^T and computes dV, dP, dQ and dK, 2 b h_q s_q s_k
    (3 d_q + 2 d_v), 2.5x the forward where d_q = d_v. k/v heads are broadcast to the query's
    (grouped-query and multi-query attention cost what multi-head attention of h_q heads does);
    a mask, dropout and causal masking change nothing (torch does not subtract the masked half)."""
    b, h_q, s_q, d_q = (int(x) for x in q)
    s_k, d_v = int(k[2]), int(v[3])
    return 2 * b * h_q * s_q * s_k * ((3 * d_q + 2 * d_v) if backward else (d_q + d_v))


def _lengths(offsets, max_len, total: int) -> list[int]:
    """Sequence lengths of a packed batch from its cumulative offsets; on fake or meta offsets
    (no values) every sequence at the longest, `max_len` (torch 2.13 `_offsets_to_lengths`)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    if isinstance(offsets, (FakeTensor, FunctionalTensor)) or offsets.device.type == "meta":
        return [int(max_len if max_len is not None else total)] * (offsets.size(0) - 1)
    return [int(n) for n in offsets.diff().tolist()]


def _packed_shapes(query, key, value, cum_q, cum_k, max_q, max_k) -> list[tuple[tuple[int, ...], ...]]:
    """(q, k, v) shapes as (b, h, s, d), one triple per sequence where the batch is packed.

    Dense: the flash and memory-efficient kernels' own layout, (b, s, h, d). Packed (cumulative
    offsets given): (total, h, d) for flash and varlen, (1, total, h, d) for memory-efficient,
    each sequence counted at its length, as torch 2.13 does
    (`_unpack_flash_attention_nested_shapes`, `_unpack_efficient_attention_nested_shapes`)."""
    if cum_q is None:
        return [tuple((t.shape[0], t.shape[2], t.shape[1], t.shape[3]) for t in (query, key, value))]
    if cum_k is None:  # varlen's self-attention: the keys' offsets are the queries'
        cum_k = cum_q
    (h_q, d_q), (h_k, d_k), (h_v, d_v) = (tuple(t.shape[-2:]) for t in (query, key, value))
    lens_q = _lengths(cum_q, max_q, query.shape[-3])
    lens_k = _lengths(cum_k, max_k, key.shape[-3])
    return [((1, h_q, sq, d_q), (1, h_k, sk, d_k), (1, h_v, sk, d_v)) for sq, sk in zip(lens_q, lens_k, strict=False)]


# Where each attention op's query (key and value follow) and, for the kernels that take packed
# batches, its cumulative query offsets (key offsets, longest query and key follow) are among
# its positional arguments (the op schemas, aten/src/ATen/native/native_functions.yaml and
# torch/nn/attention/varlen.py of PyTorch 2.13; torch's flop_registry reads the same positions),
# and whether it is a backward. The SDPA ops take (b, h, s, d) tensors.
_ATTENTION_OPS: dict[str, tuple[str, int, int | None, bool]] = {
    # name: (namespace, query at, offsets at or None, backward)
    "_scaled_dot_product_flash_attention_for_cpu": ("aten", 0, None, False),
    "_scaled_dot_product_flash_attention_for_cpu_backward": ("aten", 1, None, True),
    "_scaled_dot_product_flash_attention": ("aten", 0, None, False),
    "_scaled_dot_product_flash_attention_backward": ("aten", 1, None, True),
    "_scaled_dot_product_efficient_attention": ("aten", 0, None, False),
    "_scaled_dot_product_efficient_attention_backward": ("aten", 1, None, True),
    "_scaled_dot_product_cudnn_attention": ("aten", 0, None, False),
    "_scaled_dot_product_cudnn_attention_backward": ("aten", 1, None, True),
    # (query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, ...)
    "_flash_attention_forward": ("aten", 0, 3, False),
    # (grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, ...)
    "_flash_attention_backward": ("aten", 1, 6, True),
    # (query, key, value, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)
    "_efficient_attention_forward": ("aten", 0, 4, False),
    # (grad_out_, query, key, value, bias, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)
    "_efficient_attention_backward": ("aten", 1, 6, True),
    # torch.nn.attention.varlen, registered once that module is imported:
    # (query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, ...)
    "_varlen_attn": ("torch_attn", 0, 3, False),
    # (out, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, ...)
    "_varlen_attn_out": ("torch_attn", 1, 4, False),
    # (grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, ...)
    "_varlen_attn_backward": ("torch_attn", 1, 6, True),
}


def _attention_formula(q_at: int, offsets_at: int | None, backward: bool) -> Callable[..., int]:
    def flops(*args, out_val=None, **kwargs) -> int:
        query, key, value = args[q_at : q_at + 3]
        if offsets_at is None:
            return _attention_flops(query.shape, key.shape, value.shape, backward)
        cum_q, cum_k, max_q, max_k = (*args[offsets_at : offsets_at + 4], None, None, None, None)[:4]
        shapes = _packed_shapes(query, key, value, cum_q, cum_k, max_q, max_k)
        return sum(_attention_flops(q, k, v, backward) for q, k, v in shapes)

    return flops


def attention_formulas() -> dict[Any, Callable[..., int]]:
    """memfit's FLOP formula of every attention op this torch has, by op packet, called as
    torch's flop_registry entries are: `formula(*args, **kwargs, out_val=out)` on the op's tensors."""
    import torch

    out: dict[Any, Callable[..., int]] = {}
    for name, (namespace, q_at, offsets_at, backward) in _ATTENTION_OPS.items():
        try:
            op = getattr(getattr(torch.ops, namespace), name)
        except (AttributeError, RuntimeError):
            continue  # an op this torch lacks (or varlen's, not imported): nothing of it runs
        out[op] = _attention_formula(q_at, offsets_at, backward)
    return out


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
    """A dispatch mode that sums the FLOPs of every op torch's registry (the attention kernels'
    replaced by memfit's `attention_formulas`, plus the formulas above) knows: FlopCounterMode's
    counting without its module hooks, which would change what the traced step keeps alive under
    checkpointing. `get_total_flops()` as FlopCounterMode."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry, shape_wrapper

    attention = attention_formulas()
    registry: dict[Any, Any] = {**flop_registry, **attention}
    if hasattr(torch.ops.aten, "_grouped_mm"):
        registry[torch.ops.aten._grouped_mm] = shape_wrapper(_grouped_mm_flop)
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
                if func._overloadpacket in attention or _is_attention(func):
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
