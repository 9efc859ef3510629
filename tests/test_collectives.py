"""Every collective memfit issues goes through memfit.train.dist, which places its tensors where
the process group's backend takes them: the first H200 run died at its first checkpoint because
checkpoint.py all-reduced a CPU tensor under NCCL ("No backend type associated with device type
cpu"). CI has no GPU, so an NCCL-like backend is simulated here: a process group registered with
PyTorch for CUDA tensors only, which refuses any other tensor with NCCL's own error, and CUDA
tensors that keep their data in host memory (a tensor subclass that reports device cuda:N)."""

from __future__ import annotations

import ast
import datetime
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from memfit.train import checkpoint, long_context
from memfit.train import dist as dist_env
from memfit.train.sequence_parallel import SequenceShard

ROOT = Path(__file__).resolve().parents[1]
THE_MODULE = ROOT / "src/memfit/train/dist.py"

# torch.distributed's collectives and point-to-point calls (torch/distributed/distributed_c10d.py
# __all__), and deepspeed.comm's names for them
COLLECTIVES = frozenset(
    "all_reduce all_reduce_coalesced all_gather all_gather_into_tensor all_gather_object all_to_all "
    "all_to_all_single barrier monitored_barrier broadcast broadcast_object_list gather gather_object "
    "reduce reduce_scatter reduce_scatter_tensor reduce_scatter_fn scatter scatter_object_list send recv "
    "isend irecv batch_isend_irecv inference_all_reduce".split()
)
COMM_MODULES = (
    "torch.distributed",
    "torch.distributed.distributed_c10d",
    "torch.distributed.nn.functional",  # the autograd-aware collectives
    "deepspeed.comm",
)


def direct_collectives(source: str) -> list[str]:
    """`line: call` for every collective of torch.distributed or deepspeed.comm that `source`
    calls directly (through `import torch.distributed as x`, `from torch import distributed`,
    `from torch.distributed import all_reduce`, `torch.distributed.barrier()`, ...)."""
    tree = ast.parse(source)
    modules: set[str] = set()  # local names bound to a comm module
    functions: set[str] = set()  # local names bound to a collective itself
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in COMM_MODULES and a.asname:
                    modules.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in COMM_MODULES:
                    modules.add(a.asname or a.name)
                elif node.module in COMM_MODULES and a.name in COLLECTIVES:
                    functions.add(a.asname or a.name)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in functions:
            found.append(f"{node.lineno}: {f.id}")
        elif isinstance(f, ast.Attribute) and f.attr in COLLECTIVES:
            base = ast.unparse(f.value)
            if base in modules or base in COMM_MODULES:
                found.append(f"{node.lineno}: {base}.{f.attr}")
    return found


def test_the_scanner_finds_the_checkpoint_code_that_died_on_the_h200():
    before = (
        "def _min_over_ranks(value):\n"
        "    import torch.distributed as dist\n"
        "    t = torch.tensor([value], dtype=torch.float64)\n"
        "    dist.all_reduce(t, op=dist.ReduceOp.MIN)\n"
    )
    assert direct_collectives(before) == ["4: dist.all_reduce"]
    assert direct_collectives("import torch\ntorch.distributed.barrier()\n") == ["2: torch.distributed.barrier"]
    assert direct_collectives("from torch.distributed import all_gather as ag\nag([], t)\n") == ["2: ag"]
    assert direct_collectives("import deepspeed.comm as dc\ndc.broadcast(t, 0)\n") == ["2: dc.broadcast"]
    # what is not a collective: asking for the rank, tearing the group down
    assert direct_collectives("import torch.distributed as dist\ndist.get_rank()\ndist.destroy_process_group()\n") == []


def test_no_module_but_memfit_train_dist_issues_a_collective():
    offenders = {}
    for path in sorted([*(ROOT / "src/memfit").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]):
        if path == THE_MODULE:
            continue
        found = direct_collectives(path.read_text())
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    assert offenders == {}, f"call memfit.train.dist instead: {offenders}"


# ---- an NCCL-like backend on the CPU -------------------------------------------------------


class OnDevice(torch.Tensor):
    """A tensor that reports a CUDA device and keeps its data in host memory."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, device: torch.device):
        t = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=device, strides=data.stride())
        t.host = data
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        dev = next(a.device for a in (*args, *kwargs.values()) if isinstance(a, OnDevice))
        target = kwargs.pop("device", None)
        out = func(*tree_map(lambda a: a.host if isinstance(a, OnDevice) else a, args), **kwargs)
        if target is not None and torch.device(target).type == "cpu":
            return out  # copied back to the host: a plain tensor
        return tree_map(lambda a: OnDevice(a, dev) if type(a) is torch.Tensor else a, out)


class SimulatedCuda(TorchFunctionMode):
    """Factories and `.to()` that name a CUDA device make an OnDevice tensor."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.to:
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            if isinstance(target, (str, torch.device)) and torch.device(target).type == "cuda":
                src = args[0].host if isinstance(args[0], OnDevice) else args[0]
                return OnDevice(src.detach().clone(), torch.device(target))
        target = kwargs.get("device")
        if isinstance(target, (str, torch.device)) and torch.device(target).type == "cuda":
            kwargs["device"] = "cpu"
            return OnDevice(func(*args, **kwargs), torch.device(target))
        return func(*args, **kwargs)


def _done(result):
    fut = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class CudaOnlyGroup(dist.ProcessGroup):
    """One rank of a backend that, like NCCL, reduces CUDA tensors only: anything else is refused
    with the error NCCL's process group raised on the H200."""

    seen: list[torch.device] = []

    def allreduce(self, tensors, opts=None):
        for t in tensors:
            if t.device.type != "cuda":
                raise RuntimeError(f"No backend type associated with device type {t.device.type}")
            CudaOnlyGroup.seen.append(t.device)
        return _done(tensors)

    def barrier(self, opts=None):
        return _done(None)


BACKEND = "cuda_only_test"
dist.Backend.register_backend(BACKEND, lambda store, rank, size, timeout: CudaOnlyGroup(rank, size), devices=["cuda"])


@pytest.fixture
def nccl_like(monkeypatch):
    """A one-rank process group of the CUDA-only backend, this rank on cuda:1 (LOCAL_RANK 1)."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # what init_distributed's set_device selects
    CudaOnlyGroup.seen = []
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=0, world_size=1)
    try:
        with SimulatedCuda():
            yield CudaOnlyGroup.seen
    finally:
        dist.destroy_process_group()


@pytest.fixture
def gloo():
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_simulation_refuses_a_cpu_tensor_as_nccl_did(nccl_like):
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.tensor([1.0]))


def test_a_checkpoint_save_checks_free_disk_under_nccl(nccl_like, tmp_path):
    # the H200 run died here, in the first checkpoint's free-space check
    checkpoint.ensure_free_space(tmp_path, 1)
    assert nccl_like == [torch.device("cuda", 1)]
    with pytest.raises(checkpoint.CheckpointError, match="not enough disk"):
        checkpoint.ensure_free_space(tmp_path, shutil.disk_usage(tmp_path).free * 2)


def test_collectives_place_values_on_the_ranks_gpu_under_nccl(nccl_like, monkeypatch):
    assert dist_env.collective_device() == torch.device("cuda", 1)
    assert dist_env.all_reduce([3.0, 2**40 + 1.0], "max") == [3.0, 2**40 + 1.0]  # float64: byte counts exact
    assert dist_env.min_over_ranks(-5.0) == -5.0
    assert dist_env.all_reduce_sum([1.5]) == [1.5]
    monkeypatch.setenv("WORLD_SIZE", "2")  # tile_count reduces only where there is more than one rank
    assert long_context.tile_count(1000, 300) == 4
    dist_env.barrier()
    assert set(nccl_like) == {torch.device("cuda", 1)} and len(nccl_like) == 4


def test_a_device_tensor_is_reduced_where_it_lives(nccl_like):
    shard = SequenceShard(group=None, rank=0, size=1)
    t = torch.tensor([2.0, 3.0], device="cuda:1", requires_grad=True)
    out = shard.sum(t)
    assert out.device == torch.device("cuda", 1) and not out.requires_grad
    assert out.to("cpu").tolist() == [2.0, 3.0]
    # a CPU tensor under NCCL goes to the GPU for the reduction and comes back
    back = dist_env.all_reduce_tensor(torch.tensor([7.0]), "sum")
    assert type(back) is torch.Tensor and back.tolist() == [7.0]
    assert nccl_like == [torch.device("cuda", 1)] * 2


def test_gloo_reduces_on_the_cpu(gloo, tmp_path):
    assert dist_env.collective_device() == torch.device("cpu")
    assert dist_env.backend() == "gloo"
    assert dist_env.all_reduce([1.0, 4.0], "min") == [1.0, 4.0]
    checkpoint.ensure_free_space(tmp_path, 1)


def test_without_a_process_group_values_come_back_unchanged():
    assert not dist_env.initialized()
    assert dist_env.backend() == "none"
    assert dist_env.all_reduce([2.0, 5.0], "max") == [2.0, 5.0]
    dist_env.barrier()  # nothing to wait for


def test_rank_start_skips_deepspeed_shared_memory_allreduce_op(monkeypatch):
    """memfit's ranks start DeepSpeed's process group without its shared-memory all-reduce op, which
    only DeepSpeed inference's tensor-parallel layers use: no C++ build at install or at a rank's first
    start, and no shared-memory segment per rank (memfit.train.dist.skip_shm_comm_op)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm.torch import build_shm_op

    if get_accelerator().create_op_builder("ShareMemCommBuilder") is None:
        pytest.skip(f"the {get_accelerator().device_name()} accelerator has no shared-memory op")
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, dist_env.SHM_COMM_OP, True)
    dist_env.skip_shm_comm_op()
    assert build_shm_op() is None  # DeepSpeed's own constructor step builds nothing
