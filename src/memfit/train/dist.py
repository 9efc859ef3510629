"""The rank's place in the run (rank, world size, process group, device), and every collective
memfit issues itself.

The launcher (memfit.train.local_ranks, or torchrun) sets RANK, WORLD_SIZE and LOCAL_RANK.

Collectives go through this module and nowhere else (tests/test_collectives.py fails any other
module of memfit that calls a `torch.distributed` collective), because a backend reduces
tensors on the devices it serves only: NCCL takes CUDA tensors, and a CPU tensor fails with
"No backend type associated with device type cpu" (torch/csrc/distributed/c10d/ProcessGroup.hpp
`getBackend`; the first H200 run died so at its first checkpoint, 2026-11-27); gloo (DeepSpeed's
CPU accelerator) reduces CPU tensors. `collective_device` reads which devices the group's
backend serves from PyTorch's own table (`torch.distributed.Backend.backend_capability`: gloo
cpu+cuda, nccl cuda, xccl xpu) and places a collective's tensor on the CPU where the backend
takes it there, else on this rank's device of the type it serves (the one `init_distributed`
selected, LOCAL_RANK).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as _dist

# the reductions memfit asks for, by name: a caller needs no torch.distributed import of its own
_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def init_distributed() -> None:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    skip_shm_comm_op()  # before the process group: DeepSpeed builds the op in its backend's constructor
    # gloo on the CPU accelerator (ccl only where oneCCL is installed), nccl on CUDA.
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank())


SHM_COMM_OP = "deepspeed_shm_comm"  # deepspeed/ops/op_builder/cpu/comm.py ShareMemCommBuilder.NAME


def skip_shm_comm_op() -> None:
    """Keep DeepSpeed's CPU backend from building and starting its shared-memory all-reduce op.

    DeepSpeed's `TorchBackend.__init__` (deepspeed/comm/torch.py `build_shm_op`) JIT-compiles the
    op (ShareMemCommBuilder: two C++ files against torch's headers, about 40 s on 2 cores) and opens
    its shared-memory segment at every process-group start where the op probes compatible (the
    CPU accelerator; CUDA has no such builder). Only `inference_all_reduce` uses it, which only
    DeepSpeed inference's tensor-parallel layers call (deepspeed/module_inject/layers.py); no training
    step does. Marked incompatible in DeepSpeed's table of compatible ops (a dict cached on first
    access, whose edits persist: deepspeed/ops/__init__.py), the backend skips it.
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().create_op_builder("ShareMemCommBuilder") is None:
        return  # not this accelerator's op (CUDA): DeepSpeed never looks, nor probes the table for it
    compatible = deepspeed.ops.__compatible_ops__
    if compatible.get(SHM_COMM_OP):
        compatible[SHM_COMM_OP] = False


def initialized() -> bool:
    return _dist.is_available() and _dist.is_initialized()


def backend() -> str:
    """The default group's backend ("nccl", "gloo", ...), "none" without one."""
    return str(_dist.get_backend()) if initialized() else "none"


def collective_device(group: Any = None) -> torch.device:
    """Where a collective's tensors must live for `group`'s backend (the module docstring)."""
    served = _dist.Backend.backend_capability.get(_dist.get_backend(group), ["cpu"])
    if "cpu" in served:
        return torch.device("cpu")
    kind = served[0]
    return torch.device(kind, torch.get_device_module(kind).current_device())


def barrier(group: Any = None) -> None:
    """Every rank waits here (nothing to do on one process without a group)."""
    if initialized():
        _dist.barrier(group=group)


def finish() -> None:
    """The end of a rank: wait for every rank, then tear the process group down."""
    if initialized():
        _dist.barrier()
        _dist.destroy_process_group()


def all_reduce(values: Sequence[float], op: str = "sum", group: Any = None) -> list[float]:
    """The element-wise reduction ("sum", "max", "min") of `values` over the group's ranks, in
    float64 (byte counts up to 2**53 stay exact); the values themselves without a group."""
    t = torch.tensor(list(values), dtype=torch.float64)
    if not initialized():
        return t.tolist()
    return all_reduce_tensor(t, op, group).tolist()


def all_reduce_tensor(t: torch.Tensor, op: str = "sum", group: Any = None) -> torch.Tensor:
    """The group's reduction of `t`, as a new tensor on `t`'s device (`t` is left as it was);
    moved to the backend's device and back where they differ (a CPU value under NCCL)."""
    where = collective_device(group)
    out = t.detach().to(where, copy=True)
    _dist.all_reduce(out, op=getattr(_dist.ReduceOp, _OPS[op]), group=group)
    return out if out.device == t.device else out.to(t.device)


def all_reduce_sum(values: Sequence[float]) -> list[float]:
    return all_reduce(values, "sum")


def all_reduce_max(values: Sequence[float]) -> list[float]:
    return all_reduce(values, "max")


def min_over_ranks(value: float) -> float:
    return all_reduce([value], "min")[0]


def device() -> torch.device:
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().device_name(local_rank()))
