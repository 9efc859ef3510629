"""What a rank does before its first import of DeepSpeed so that it starts in seconds: two costs
paid at every start of every rank for nothing memfit uses (measured with cProfile on a 6-step
demo-model rank on 2 cores: 12.3 s, of which 2.3 s py-cpuinfo and 1.6 s torch.compile set-up).

- `memoize_cpu_info`: py-cpuinfo's answer kept per machine in a file;
- `defer_torch_compile`: functions decorated with `torch.compile` at import time (DeepSpeed's
  Muon optimizer, bitsandbytes' default kernels) set up their compiler at their first call.

And one the launcher does before it starts any rank: `clear_stale_build_locks`, so that a build of
DeepSpeed's JIT ops killed midway does not make every later rank wait forever.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from memfit.atomic import write_json_atomic


def cpu_info_cache_file() -> Path | None:
    """Where this machine's py-cpuinfo answer is kept: beside DeepSpeed's JIT-built CPU ops
    (TORCH_EXTENSIONS_DIR, which `launch_env` sets to the environment's), named by a hash of what
    identifies the CPU to a compiler (architecture, model name and feature flags from /proc/cpuinfo;
    on Arm its "Features" and CPU implementer/part lines),
    so nodes with other CPUs sharing that directory get files of their own. None where there is
    no /proc/cpuinfo to key it by."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    first = text.split("\n\n", 1)[0]  # one processor's block: every core of a node is the same model
    keys = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    ident = [platform.machine()] + [ln for ln in first.splitlines() if ln.startswith(keys)]
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(sys.prefix, "torch_extensions")
    key = hashlib.sha256("\n".join(ident).encode()).hexdigest()[:16]
    return Path(root) / f"memfit-cpuinfo-{key}.json"


def memoize_cpu_info() -> None:
    """Answer py-cpuinfo's `get_cpu_info()` from a file after its first run on this machine.

    It measures the clock in a subprocess for about a second per call, and DeepSpeed calls it
    twice each time a rank loads a JIT-built CPU op, built or not (`cpu_arch` and `simd_width` in
    deepspeed/ops/op_builder/builder.py, for FusedAdam and CPU-Adam; `DeepSpeedCPUAdam.__init__`
    in deepspeed/ops/adam/cpu_adam.py once more): measured 2.3 s of a 12 s demo-model rank on 2
    cores. DeepSpeed reads only `arch` and `flags` of the answer (the compiler's -march and SIMD
    width), which the cache key holds; `hz_actual` and the other clock readings are the first
    run's."""
    try:
        import cpuinfo
    except ImportError:  # DeepSpeed then asks lscpu (builder.py `_backup_cpuinfo`)
        return
    if getattr(cpuinfo.get_cpu_info, "memfit_cached", False):
        return
    measure = cpuinfo.get_cpu_info
    path = cpu_info_cache_file()

    @functools.cache
    def get_cpu_info() -> dict[str, Any]:
        if path is not None:
            try:
                return json.loads(path.read_text())
            except (OSError, ValueError):
                pass
        info = measure()
        if path is not None:
            try:
                write_json_atomic(path, info)
            except OSError:  # a read-only extensions directory: measured again next time
                pass
        return info

    get_cpu_info.memfit_cached = True  # type: ignore[attr-defined]
    cpuinfo.get_cpu_info = get_cpu_info


def defer_torch_compile() -> None:
    """Make `torch.compile(fn)` of a plain function set the compiler up at the function's first call.

    `torch.compile` builds its inductor backend when it is called (torch/__init__.py `compile` ->
    `_TorchCompileInductorWrapper`, importing torch._inductor.compile_fx: 0.9-1.6 s), and
    DeepSpeed's ZeRO optimizer check imports its Muon optimizer module, which decorates three
    functions with it (deepspeed/runtime/zero/utils.py `is_zero_supported_optimizer` ->
    zero/muon/original_muon.py), as bitsandbytes decorates two of its default kernels
    (backends/default/ops.py). A memfit rank calls none of them in most runs; one that is called
    is compiled at that call with the same arguments, exactly as before. Modules (`nn.Module`)
    and calls that are not plain functions go to `torch.compile` unchanged."""
    real = torch.compile
    if getattr(real, "memfit_deferred", False):
        return

    def compile(model: Any = None, **kwargs: Any) -> Any:
        if model is None:  # used as @torch.compile(...): the decorator
            return lambda fn: compile(fn, **kwargs)
        if isinstance(model, torch.nn.Module) or not callable(model):
            return real(model, **kwargs)
        compiled: list[Callable] = []

        @functools.wraps(model)
        def first_call_compiles(*args: Any, **kw: Any) -> Any:
            if not compiled:
                compiled.append(real(model, **kwargs))
            return compiled[0](*args, **kw)

        return first_call_compiles

    compile.memfit_deferred = True  # type: ignore[attr-defined]
    torch.compile = compile


# A build of a DeepSpeed JIT op (FusedAdam, CPU-Adam) takes 0.5-2 minutes: about a minute with nvcc on
# the H200 check (benchmarks/results/gpu_check_h200), 30-60 s with g++ on 2 CPU cores. A lock 15
# minutes old has no build behind it.
STALE_BUILD_LOCK_S = 15 * 60


def clear_stale_build_locks(root: str | os.PathLike | None = None, now: float | None = None) -> list[Path]:
    """Remove the build locks of DeepSpeed's JIT-built ops older than STALE_BUILD_LOCK_S, saying so
    on stderr; returns them. torch builds an op under a lock file in its build folder
    (torch/utils/cpp_extension.py `_jit_compile`: `FileBaton(<TORCH_EXTENSIONS_DIR>/<op>/lock)`)
    and removes it when done; a build killed midway (Ctrl-C, a killed rank) leaves it, and every
    later load of that op waits on it forever without a word (torch/utils/file_baton.py `wait`).
    `root`: the extensions folder the ranks use (TORCH_EXTENSIONS_DIR, `launch.launch_env`)."""
    folder = Path(root or os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(sys.prefix, "torch_extensions"))
    now = time.time() if now is None else now
    removed = []
    for lock in sorted(folder.glob("*/lock")):
        try:
            age = now - lock.stat().st_mtime
            if age < STALE_BUILD_LOCK_S:
                continue
            lock.unlink()
        except OSError:  # gone meanwhile (its build finished), or not ours to remove
            continue
        removed.append(lock)
        print(
            f"memfit: removed {lock}, a build lock {age / 60:.0f} minutes old: a build of that op was "
            "killed midway, and torch would wait on its lock forever; the op is built again",
            file=sys.stderr,
        )
    return removed
