"""The distributions a bare GPU machine lacks to run memfit's whole workflow, as `name==version`
lines (benchmarks/fetch_gpu_wheels.sh downloads them; benchmarks/gpu_check.sh installs them).

The machines memfit is lent (benchmarks/gpu_check.sh) come with PyTorch, CUDA and a scientific
Python stack preinstalled and reach no network. What memfit needs there is the closure of its
runtime requirements (pyproject.toml's `dependencies`, read from the installed metadata of this
venv, so at the versions of requirements-cpu.lock) for the machine's Python (3.12) on Linux,
minus what the image already holds (benchmarks/gpu_image_packages.txt), plus the packages whose
version decides what memfit does (CARRY_ALWAYS: the image's transformers 5.17 is not the 5.24
memfit is tested with), minus what must not travel (NEVER: torch and its CUDA libraries are the
machine's own; bitsandbytes' 60 MB wheel would not fit the 64 MiB a call carries, and the QLoRA
stages of gpu_evidence.py skip without it). gpu_evidence.py's trainer_speed stage
(benchmarks/bench_trainer_speed.py) adds TRL, the trainer memfit is measured against, with its own
closure beyond memfit's (BENCHMARK_ROOTS), and liger-kernel (PINNED): together 2.7 MiB of wheels
(`pip download --no-deps trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
liger-kernel==0.8.5`, 2026-11-28).

    .venv/bin/python benchmarks/gpu_wheels.py [--python 3.12]
"""

from __future__ import annotations

import argparse
import re
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

IMAGE = Path(__file__).with_name("gpu_image_packages.txt")
CARRY_ALWAYS = frozenset({"deepspeed", "transformers", "peft", "tokenizers", "huggingface-hub"})
NEVER = frozenset({"torch", "triton", "bitsandbytes", "setuptools"})
# benchmarks/bench_trainer_speed.py's other side: TRL (pyproject's dev extra) at this venv's version
BENCHMARK_ROOTS = ("trl",)
# not installed in the CPU venv (Liger's Triton kernels need CUDA): the floor of pyproject's `liger`
# extra, the release memfit.train.liger calls; a pure-Python wheel (triton is the image's, with torch)
PINNED = {"liger-kernel": "0.8.5"}


def norm(name: str) -> str:
    """PEP 503's normalised name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(path: Path = IMAGE) -> set[str]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {norm(line) for line in lines if line}


def runtime_closure(root: str = "memfit", python: str = "3.12") -> dict[str, str]:
    """{name: installed version} of `root`'s runtime requirements and theirs, markers evaluated
    for CPython `python` on Linux x86-64 (extras of `root` itself left out: dev, gpu)."""
    env = default_environment() | {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
    }
    out: dict[str, str] = {}
    walked: dict[str, set[str]] = {}  # the extras each distribution was walked with
    todo = [(Requirement(r), ("",)) for r in distribution(root).requires or [] if "extra ==" not in r]
    while todo:
        req, extras = todo.pop()
        if req.marker and not any(req.marker.evaluate(env | {"extra": e}) for e in extras):
            continue
        name = norm(req.name)
        if name in walked and set(req.extras) <= walked[name]:
            continue
        walked.setdefault(name, set()).update(req.extras)
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            raise SystemExit(f"{req.name} is required but not installed here: run `make install` first") from None
        out[name] = dist.version
        todo += [(Requirement(r), ("", *req.extras)) for r in dist.requires or []]
    return out


def to_carry(python: str = "3.12") -> dict[str, str]:
    have = image_packages()
    closure = runtime_closure(python=python)
    for root in BENCHMARK_ROOTS:
        closure |= runtime_closure(root, python) | {norm(root): distribution(root).version}
    closure |= PINNED
    return {n: v for n, v in sorted(closure.items()) if n not in NEVER and (n in CARRY_ALWAYS or n not in have)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default="3.12", help="the GPU machine's Python version (default 3.12)")
    a = ap.parse_args(argv)
    for name, version in to_carry(a.python).items():
        print(f"{name}=={version}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
