"""What a training step really holds in memory, on any device.

`AllocationTracker` counts the bytes of live tensor storages, the quantity
`torch.cuda.max_memory_allocated` reports on a GPU, and works on the CPU where
PyTorch keeps no such statistic. It is the ground truth for probes on `cpu`
and for the estimator's tests. It follows the approach of PyTorch's own
`torch.distributed._tools.mem_tracker.MemTracker` (a `TorchDispatchMode` that
sees every op's outputs, and weak references on their storages that fire when
a storage is freed), without module attribution, so it composes with
DeepSpeed's own module hooks.

With `capacity_bytes` set, the tracker is also the `cpu` device's capacity: when
the live total of this rank would exceed it, the op raises `torch.OutOfMemoryError`,
the exception CUDA's caching allocator raises, so the trainer's OOM handler
(memfit.train.rank.run_rank: OOM marker + OOM_EXIT_CODE) treats both alike. PyTorch 2.x has
no pluggable CPU allocator (`torch.cuda.memory.CUDAPluggableAllocator` is
CUDA-only, and c10's CPU allocator is replaced only from C++ via
`c10::SetCPUAllocator`), so the check runs right after the op: its outputs are
already allocated when the dispatch mode sees them, and the error drops them.
The peak recorded therefore may exceed the capacity by one op's outputs, as a
real device never would.

On CUDA, `device_peaks()` reads the caching allocator's own statistics instead
(allocated and reserved), which include what no Python op returns.
"""

from __future__ import annotations

import gc
import resource
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memfit.train.stream_load import is_file_backed
from memfit.units import fmt_bytes


class AllocationTracker(TorchDispatchMode):
    """Peak bytes of live tensor storages on `device` while the context is active.

    `baseline_bytes` counts storages alive when tracking starts (parameters,
    optimizer states, buffers reachable from Python); `peak_bytes` is the
    highest total reached, baseline included; `current_bytes` the total now.
    Views share a storage and count once; a storage freed before the peak is
    not counted at the peak, as in the CUDA caching allocator's `allocated`.
    """

    def __init__(self, device: str | torch.device = "cpu", capacity_bytes: int | None = None) -> None:
        super().__init__()
        self.capacity_bytes = capacity_bytes
        self.phase = "setup"  # what the caller is doing: forward, backward, optimizer step, checkpoint save ...
        self.oom: dict[str, object] | None = None  # phase, live and capacity bytes of the first OOM
        self.device_type = torch.device(device).type
        self._live: dict[int, int] = {}  # storage key -> nbytes
        self._refs: dict[int, weakref.ref] = {}
        self._lock = threading.Lock()
        self.current_bytes = 0
        self.peak_bytes = 0
        self.baseline_bytes = 0

    # -- bookkeeping ---------------------------------------------------------
    def _track(self, t: torch.Tensor) -> None:
        if t.device.type != self.device_type or t.is_meta or isinstance(t, FakeTensor):
            return  # meta and fake tensors (a trace's leftovers in this process) hold no memory
        try:
            st = t.untyped_storage()
        except (NotImplementedError, RuntimeError):
            return  # sparse, nested or otherwise storage-less tensors
        nbytes = st.nbytes()
        if nbytes == 0 or is_file_backed(st):
            return  # a mapped checkpoint file's pages are page cache, not allocations (train.stream_load)
        key = st._cdata  # the C++ StorageImpl address, stable while the storage lives
        with self._lock:
            if key in self._live:
                return
            self._live[key] = nbytes
            self.current_bytes += nbytes
            if self.current_bytes > self.peak_bytes:
                self.peak_bytes = self.current_bytes
        self._refs[key] = weakref.ref(st, lambda _ref, k=key: self._free(k))

    def _check_capacity(self, op: str) -> None:
        """Raise torch.OutOfMemoryError when the live total exceeds `capacity_bytes`."""
        cap = self.capacity_bytes
        if cap is None or self.current_bytes <= cap:
            return
        live = self.current_bytes
        self.oom = {"phase": self.phase, "op": op, "live_bytes": live, "capacity_bytes": cap}
        raise torch.OutOfMemoryError(
            f"CPU device capacity exceeded in {self.phase} ({op}): {fmt_bytes(live)} live "
            f"> capacity {fmt_bytes(cap)} (live {live} B, capacity {cap} B)"
        )

    def _free(self, key: int) -> None:
        with self._lock:
            nbytes = self._live.pop(key, 0)
            self.current_bytes -= nbytes
        self._refs.pop(key, None)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.current_bytes

    # -- torch.compile ---------------------------------------------------------
    # A higher-order operator (compiled code with gradient checkpointing calls
    # run_and_save_rng_state) reaches __torch_dispatch__ with this mode popped
    # (torch/_ops.py HigherOrderOperator.dispatch), which runs it and counts its outputs; with
    # the default False it raised NotImplementedError in every compiled checkpointed step.
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let dynamo compile while the tracker is on (torch/utils/_python_dispatch.py): with the
        default False, torch/_dynamo/convert_frame.py skips every frame while a TorchDispatchMode
        is on the stack ("non-infra torch dispatch mode present"), so `compile: true` ran eagerly
        in every CPU probe, calibration and training run (measured: 0 graphs compiled; issue #45).
        The tracker is off while dynamo and inductor compile and on while the compiled code runs:
        it sees the aten ops that code calls (the matmuls' `out=` buffers, attention), not the
        buffers inductor's own C++ kernels fill; those saved for the backward are counted by
        `_pack` (docs/speed.md, "Searching compile": what the compiled peak leaves out)."""
        return True

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        """Saved-tensor hook: a tensor autograd keeps for the backward is live memory. Eager ops
        hand each of them to `__torch_dispatch__` first (a no-op here); a compiled layer's are
        filled by inductor's kernels, which the tracker does not see (3.7 of the demo model's 24.7 MB
        saved in one forward of 8 x 24 tokens were seen only here). It returns a detached alias, not
        `t`: a pack hook's value that holds its input makes a reference cycle (torch/autograd/graph.py,
        `saved_tensors_hooks`), so every saved output lived until the garbage collector ran, and
        the tracker measured the CPU's eager steps up to 10% high (tests/test_coverage.py)."""
        self._track(t)
        return t.detach()

    # -- context -------------------------------------------------------------
    def __enter__(self) -> AllocationTracker:
        gc.collect()
        with warnings.catch_warnings():  # isinstance() on deprecated module attributes warns
            warnings.simplefilter("ignore")
            for obj in gc.get_objects():
                try:
                    if isinstance(obj, torch.Tensor):
                        self._track(obj)
                except ReferenceError:
                    continue
        self.baseline_bytes = self.current_bytes
        self.peak_bytes = self.current_bytes
        self._check_capacity("baseline")  # parameters and optimizer states alone do not fit
        # only where layers were compiled (memfit.train.compile): eager runs keep the tracker they
        # were validated with; with the hook on, a ZeRO-3 packed SFT run's training peak rose above
        # its probe's (58.3 against 54.6 MB, tests/test_train.py), which no longer holds the worst case
        from memfit.train.compile import layers_compiled

        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack) if layers_compiled() else None
        if self._saved_hooks is not None:
            self._saved_hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        self._check_capacity(str(func))
        return out


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass
class Peaks:
    """Peak memory of one rank, bytes. `reserved` is None where no caching allocator exists."""

    allocated: int
    reserved: int | None
    host_rss: int  # peak resident set size of this process (the host side)


def host_peak_rss_bytes() -> int:
    """Peak RSS of this process. Linux reports ru_maxrss in KiB, macOS in bytes (getrusage(2))."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def cuda_available() -> bool:
    return torch.cuda.is_available()


def reset_device_peaks() -> None:
    if cuda_available():
        torch.cuda.reset_peak_memory_stats()


def device_peaks(tracker: AllocationTracker | None = None) -> Peaks:
    """Peaks since the last reset: CUDA allocator statistics on a GPU, the tracker elsewhere."""
    if cuda_available():
        return Peaks(
            allocated=int(torch.cuda.max_memory_allocated()),
            reserved=int(torch.cuda.max_memory_reserved()),
            host_rss=host_peak_rss_bytes(),
        )
    return Peaks(
        allocated=int(tracker.peak_bytes) if tracker is not None else 0,
        reserved=None,
        host_rss=host_peak_rss_bytes(),
    )
