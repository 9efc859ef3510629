"""The conda env files pin what the CPU install tests: every `name==version` pin of a package
installed here must equal its installed version (torch compared without the local `+cpu`/`+cuXXX`
tag, since the GPU env takes the CUDA build of the same release)."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
import yaml

ENVS = sorted((Path(__file__).resolve().parents[1] / "envs").glob("*.yaml"))
# Packages that live only in the GPU env (need CUDA), so the CPU install cannot check them.
GPU_ONLY = {"flash-attn", "bitsandbytes"}


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
def test_env_pins_equal_installed_versions(env_file):
    pins = _pins(env_file)
    assert "torch" in pins and "deepspeed" in pins, f"{env_file.name} must pin torch and deepspeed"
    wrong = {}
    for name, pinned in pins.items():
        if name in GPU_ONLY:
            continue
        installed = importlib.metadata.version(name).split("+")[0]
        if installed != pinned:
            wrong[name] = f"{env_file.name} pins {pinned}, installed {installed}"
    assert not wrong, wrong


def test_gpu_env_pins_the_cuda_only_packages():
    gpu = next(p for p in ENVS if p.name == "memfit-gpu.yaml")
    assert GPU_ONLY <= set(_pins(gpu))
