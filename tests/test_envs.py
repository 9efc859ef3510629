"""One lock for every install: requirements-cpu.lock (written by `make lock` with uv) is what the
CPU install puts in place, and the conda env files pin the same versions (torch without the
local `+cpu`/`+cuXXX` tag, since the GPU env takes the CUDA build of the same release)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
ENVS = sorted((REPO / "envs").glob("*.yaml"))
# Packages that live only in the GPU env (need CUDA), so the CPU lock does not hold them.
GPU_ONLY = {"flash-attn", "liger-kernel"}


def _tool():
    spec = importlib.util.spec_from_file_location("sync_env_pins", REPO / "tools/sync_env_pins.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _pins(env_file: Path) -> dict[str, str]:
    spec = yaml.safe_load(env_file.read_text())
    pins: dict[str, str] = {}
    for dep in spec["dependencies"]:
        if isinstance(dep, dict):
            for line in dep.get("pip", []):
                m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;#]+)", line.strip())
                if m:
                    pins[m.group(1).lower()] = m.group(2)
    return pins


def test_env_files_exist():
    assert {p.name for p in ENVS} >= {"memfit-cpu.yaml", "memfit-gpu.yaml"}


@pytest.mark.parametrize("env_file", ENVS, ids=lambda p: p.name)
def test_env_pins_equal_the_lock(env_file):
    tool = _tool()
    locked = tool.locked_versions(REPO / "requirements-cpu.lock")
    pins = _pins(env_file)
    assert "torch" in pins and "deepspeed" in pins, f"{env_file.name} must pin torch and deepspeed"
    wrong = {
        n: f"{env_file.name} pins {v}, the lock {locked.get(n)}"
        for n, v in pins.items()
        if n not in GPU_ONLY and locked.get(n) != v
    }
    assert not wrong, f"{wrong}: run `make lock`"
    missing = [d for d in tool.direct_dependencies(REPO / "pyproject.toml") if d not in pins]
    assert not missing, f"{env_file.name} lacks pins for memfit's dependencies {missing}: run `make lock`"


def test_installed_versions_equal_the_lock():
    """A fresh `make install` puts exactly the locked versions in place."""
    locked = _tool().locked_versions(REPO / "requirements-cpu.lock")
    assert {"torch", "deepspeed", "transformers", "pyyaml", "pandas"} <= locked.keys()
    wrong = {}
    for name, version in locked.items():
        installed = importlib.metadata.version(name).split("+")[0]
        if installed != version:
            wrong[name] = f"locked {version}, installed {installed}"
    assert not wrong, f"{wrong}: run `make install` (the venv drifted from requirements-cpu.lock)"


def test_lock_pins_the_cpu_torch_and_no_cuda_packages():
    text = (REPO / "requirements-cpu.lock").read_text()
    assert re.search(r"^torch==2\.13\.0\+cpu$", text, re.M), "the CPU install must lock the CPU wheel"
    assert not re.search(r"^(nvidia-|triton==)", text, re.M), "a CUDA torch leaked into the CPU lock"


def test_sync_rewrites_a_stale_pin_and_adds_a_missing_dependency():
    tool = _tool()
    env = "dependencies:\n  - pip:\n      - torch==2.0.0  # note\n      - -e ..\n"
    out = tool.synced(env, {"torch": "2.13.0", "pandas": "3.1.1"}, ["torch", "pandas"])
    assert "      - torch==2.13.0  # note\n      - pandas==3.1.1\n      - -e ..\n" in out


def test_gpu_env_pins_the_cuda_only_packages():
    gpu = next(p for p in ENVS if p.name == "memfit-gpu.yaml")
    assert GPU_ONLY <= set(_pins(gpu))
