"""A rank's start-up shortcuts (memfit.train.startup): py-cpuinfo answered from a per-machine file,
torch.compile of import-time decorated functions set up at their first call."""

import json
import os
import subprocess
import sys
import time

import cpuinfo
import pytest
import torch

from memfit.train import startup


@pytest.fixture
def fresh_cpuinfo(monkeypatch, tmp_path):
    """cpuinfo.get_cpu_info replaced by a counting stand-in for the real measurement (which takes
    about a second); the cache directory is tmp_path."""
    calls = []

    def measure():
        calls.append(1)
        return {"arch": "X86_64", "flags": ["avx2", "avx512f"], "brand_raw": "test cpu"}

    monkeypatch.setattr(cpuinfo, "get_cpu_info", measure)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    return calls


def test_cpu_info_is_measured_once_per_machine(fresh_cpuinfo, monkeypatch, tmp_path):
    if startup.cpu_info_cache_file() is None:
        pytest.skip("no /proc/cpuinfo to key the cache by")
    measure = cpuinfo.get_cpu_info
    startup.memoize_cpu_info()
    first = cpuinfo.get_cpu_info()
    assert cpuinfo.get_cpu_info() == first and len(fresh_cpuinfo) == 1  # once per process
    [cached] = tmp_path.glob("memfit-cpuinfo-*.json")
    assert json.loads(cached.read_text()) == first
    # The next rank on this machine (a new process: the original function again) reads the file.
    monkeypatch.setattr(cpuinfo, "get_cpu_info", measure)
    startup.memoize_cpu_info()
    assert cpuinfo.get_cpu_info() == first and len(fresh_cpuinfo) == 1
    # DeepSpeed's op builders read the cached answer: the flags decide the SIMD width.
    from deepspeed.ops.op_builder.cpu import FusedAdamBuilder

    assert FusedAdamBuilder().simd_width() == "-D__AVX512__"


def test_a_corrupt_cache_file_is_measured_again(fresh_cpuinfo, tmp_path):
    path = startup.cpu_info_cache_file()
    if path is None:
        pytest.skip("no /proc/cpuinfo to key the cache by")
    path.write_text("{not json")
    startup.memoize_cpu_info()
    assert cpuinfo.get_cpu_info()["arch"] == "X86_64" and len(fresh_cpuinfo) == 1
    assert json.loads(path.read_text())["arch"] == "X86_64"


def test_compile_of_a_function_happens_at_its_first_call(monkeypatch):
    compiled = []

    def real(model=None, **kwargs):
        compiled.append((model, kwargs))
        return lambda *a, **k: ("compiled", model(*a, **k))

    monkeypatch.setattr(torch, "compile", real)
    startup.defer_torch_compile()

    @torch.compile(dynamic=False)
    def double(x):
        return 2 * x

    assert compiled == [] and double.__name__ == "double"  # decorating compiles nothing
    assert double(3) == ("compiled", 6) and double(4) == ("compiled", 8)
    assert len(compiled) == 1 and compiled[0][1] == {"dynamic": False}  # once, with the decorator's arguments
    module = torch.nn.Linear(2, 2)
    torch.compile(module)  # a module is compiled (wrapped) at once, as torch does
    assert compiled[-1][0] is module


def test_a_rank_start_imports_no_compiler():
    """What the shortcut buys: DeepSpeed's ZeRO optimizer check imports its Muon module, whose
    torch.compile decorators would import the inductor backend (about a second per rank)."""
    code = (
        "import sys; from memfit.train.startup import defer_torch_compile; defer_torch_compile();"
        "import deepspeed.runtime.zero.muon.original_muon;"
        "print('torch._inductor.compile_fx' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_fresh_one_kept(tmp_path, capsys):
    # torch waits forever on <TORCH_EXTENSIONS_DIR>/<op>/lock: a killed build of FusedAdam left one
    # and every later rank hung silently; a lock younger than a build can take is another's build
    stale, fresh = tmp_path / "fused_adam" / "lock", tmp_path / "cpu_adam" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir()
        lock.touch()
    now = time.time()
    os.utime(stale, (now - 20 * 60, now - 20 * 60))
    os.utime(fresh, (now - 60, now - 60))
    assert startup.clear_stale_build_locks(tmp_path, now=now) == [stale]
    assert not stale.exists() and fresh.exists()
    err = capsys.readouterr().err
    assert str(stale) in err and "20 minutes old" in err and "killed midway" in err
    assert startup.clear_stale_build_locks(tmp_path / "missing") == []  # no extensions built yet


def test_the_launcher_clears_a_stale_build_lock_before_it_starts_the_ranks(tmp_path, capsys):
    from memfit.train import launch

    lock = tmp_path / "fused_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()
    old = time.time() - 60 * 60
    os.utime(lock, (old, old))
    env = launch.launch_env() | {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    proc = launch._start([sys.executable, "-c", "pass"], 1, env, None, None, None, srun=False)
    assert proc.wait(timeout=60) == 0
    assert not lock.exists() and str(lock) in capsys.readouterr().err
