"""Checkpoint files read through mmap and copied a chunk at a time: a resume never holds a file twice.

DeepSpeed's `TorchCheckpointEngine.load` is `torch.load(path, map_location="cpu")`
(deepspeed/runtime/checkpoint_engine/torch_checkpoint_engine.py), which reads every tensor of
the file into new host memory before anything is copied to where it belongs: each rank holds its
whole optimizer shard (12 bytes per trainable parameter / ranks in fp32: master, m, v) and at
ZeRO-0/1/2 the whole 16-bit module (`mp_rank_00_model_states.pt`, read by every rank of the node)
in anonymous host memory, beside what training allocates. On a GPU node that is the host OOM of
a resume; on the CPU device it is device memory.

While `streamed_loading()` is active, the files are mapped instead (`torch.load(mmap=True)`,
PyTorch >= 2.1; pages come from the page cache, which the node's ranks share and the kernel can
reclaim) and every copy out of a mapped tensor (`copy_` into existing state, `.to(device or
dtype)`, `clone`) runs as a `TorchDispatchMode` that copies `CHUNK_BYTES` at a time and drops
each chunk's pages from the process with `madvise(MADV_DONTNEED)` once copied (madvise(2): for a
private file mapping "subsequent accesses of pages in the range will result in repopulation of the
memory contents from the up-to-date contents of the underlying mapped file", so a tensor read
again is still correct). A rank thus maps at most one chunk of a checkpoint at a time on top of
what it holds for training. The checkpoint format and DeepSpeed's call path are unchanged; only
files in torch's zip format (DeepSpeed's default, `checkpoint_serialization: true`) are mapped,
others load as before.

Every file loads with `weights_only=True` and the allow-list of DeepSpeed's own classes
(memfit.train.checkpoint_digest `load_weights_only`): a file of a run folder never runs code, and
`memfit.train.checkpoint.load` has checked its SHA-256 against memfit's manifest before.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memfit.train.checkpoint_digest import load_weights_only
from memfit.units import CHECKPOINT_CHUNK_BYTES as CHUNK_BYTES

_MADV_DONTNEED = 4  # <asm-generic/mman-common.h>
_PAGE = mmap.PAGESIZE

_mapped: list[tuple[int, int]] = []  # [start, end) addresses of the mapped files being loaded
_mapping = False  # torch.load(mmap=True) is building tensors on the mapped file now
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _storage_range(t: torch.Tensor) -> tuple[int, int] | None:
    if not torch.is_tensor(t) or t.device.type != "cpu" or t.is_meta:
        return None
    try:
        st = t.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return None
    return (st.data_ptr(), st.data_ptr() + st.nbytes()) if st.nbytes() else None


def is_file_backed(t: torch.Tensor | torch.UntypedStorage) -> bool:
    """Whether `t`'s memory lies in a checkpoint file mapped by `load` and not yet released."""
    if not _mapped:
        return False
    if isinstance(t, torch.UntypedStorage):
        if t.device.type != "cpu" or not t.nbytes():
            return False
        ptr = t.data_ptr()
    else:
        r = _storage_range(t)
        if r is None:
            return False
        ptr = r[0]
    return any(lo <= ptr < hi for lo, hi in _mapped)


def release(ptr: int, nbytes: int) -> None:
    """Drop the whole pages inside [ptr, ptr + nbytes) of a mapped file from this process."""
    start = -(-ptr // _PAGE) * _PAGE
    end = (ptr + nbytes) // _PAGE * _PAGE
    if _libc is not None and end > start:
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


def load(path: str, map_location: Any = None) -> Any:
    """`torch.load(path, map_location, weights_only=True)` (DeepSpeed's classes allow-listed) with
    the file mapped where torch's zip format allows it (its tensors registered as file-backed until
    `streamed_loading` ends)."""
    with open(path, "rb") as fh:
        zipped = torch.serialization._is_zipfile(fh)
    if not zipped:
        return load_weights_only(path, map_location=map_location)
    global _mapping
    before = len(_mapped)
    _mapping = True  # the tensors torch.load sets onto the mapping count as file-backed at once
    try:
        obj = load_weights_only(path, map_location=map_location, mmap=True)
    finally:
        _mapping = False
    ranges = _mapped[before:] + [r for r in map(_storage_range, tree_flatten(obj)[0]) if r is not None]
    del _mapped[before:]
    if ranges:  # one interval for the file: is_file_backed stays a short scan
        _mapped.append((min(r[0] for r in ranges), max(r[1] for r in ranges)))
    return obj


def _streamed_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)` for same-shaped contiguous tensors, `CHUNK_BYTES` of `src` at a time, each
    chunk's pages released once copied."""
    d, s = dst.view(-1), src.view(-1)
    step = max(1, CHUNK_BYTES // src.element_size())
    for a in range(0, s.numel(), step):
        d[a : a + step].copy_(s[a : a + step])
        release(src.data_ptr() + a * src.element_size(), s[a : a + step].numel() * src.element_size())


def _simple(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.layout == torch.strided and not t.is_quantized


class _StreamFromFile(TorchDispatchMode):
    """Copies out of mapped checkpoint tensors run chunk by chunk, releasing what they read."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if _mapping and func is aten.set_.source_Storage_storage_offset:
            storage = args[1]  # a slice of the mapped file (torch/serialization.py `_load`)
            if isinstance(storage, torch.UntypedStorage) and storage.device.type == "cpu" and storage.nbytes():
                _mapped.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
            return func(*args, **kwargs)
        if func is aten.copy_.default and not kwargs:
            dst, src = args[0], args[1]
            if is_file_backed(src) and _simple(src) and _simple(dst) and dst.shape == src.shape:
                _streamed_copy(dst, src)
                return dst
        elif func in (aten._to_copy.default, aten.clone.default) and is_file_backed(args[0]) and _simple(args[0]):
            src = args[0]
            layout = kwargs.get("layout")
            if layout in (None, torch.strided) and kwargs.get("memory_format") in (None, torch.contiguous_format):
                out = torch.empty(
                    src.shape,
                    dtype=kwargs.get("dtype") or src.dtype,
                    device=kwargs.get("device") or src.device,
                    pin_memory=bool(kwargs.get("pin_memory")),
                )
                _streamed_copy(out, src)
                return out
        return func(*args, **kwargs)


def own_memory(module: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> int:
    """Give every parameter, buffer and optimizer state tensor that still points into a mapped file
    (adopted rather than copied by a loader) memory of its own, so that nothing depends on the
    checkpoint file after the load (it may be deleted or rewritten). Returns how many moved."""
    moved = 0
    for t in [*(module.parameters() if module else ()), *(module.buffers() if module else ())]:
        if is_file_backed(t):
            t.data = t.data.clone()
            moved += 1
    for state in optimizer.state.values() if optimizer is not None else ():
        for k, v in list(state.items()):
            if is_file_backed(v):
                state[k] = v.clone()
                moved += 1
    return moved


@contextlib.contextmanager
def streamed_loading(engine=None) -> Iterator[None]:
    """While active: `engine.checkpoint_engine` (DeepSpeed's torch engine only) maps the files it
    loads, and copies out of them stream. Other checkpoint engines (Nebula, decoupled, fast
    writers) keep their own load. On leaving, nothing stays file-backed in memfit's bookkeeping."""
    ce = getattr(engine, "checkpoint_engine", None)
    patched = ce is not None and type(ce).__name__ == "TorchCheckpointEngine"
    if patched:
        ce.load = load  # an instance attribute over the class's method
    try:
        with _StreamFromFile():
            yield
    finally:
        if patched:
            ce.__dict__.pop("load", None)
        _mapped.clear()
