"""The rank's place in the run: rank, world size, process group, all-reduce and device helpers
(moved out of train.py; the launcher, memfit.train.local_ranks or torchrun, sets RANK, WORLD_SIZE
and LOCAL_RANK)."""

from __future__ import annotations

import os

import torch


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed() -> None:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    # gloo on the CPU accelerator (ccl only where oneCCL is installed), nccl on CUDA.
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def all_reduce_sum(values: list[float]) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def all_reduce_max(values: list[float]) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def device() -> torch.device:
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", "0"))))
