"""benchmarks/gpu_wheels.py: what a bare GPU machine lacks to run memfit (benchmarks/gpu_check.sh)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_wheels_carried_are_memfits_closure_less_the_image_plus_the_pinned():
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/gpu_wheels.py")], capture_output=True, text=True, check=True
    ).stdout.split()
    carried = dict(line.split("==") for line in out)
    # what the image lacks: the workflow engine and DeepSpeed (no PyPI wheel: built by fetch_gpu_wheels.sh)
    assert {"snakemake", "deepspeed", "pulp", "jsonschema", "hjson", "pydantic"} <= set(carried)
    # what the image has at another version than memfit is tested with: carried at the lock's
    lock = (REPO / "requirements-cpu.lock").read_text()
    for name in ("transformers", "peft", "tokenizers", "huggingface-hub"):
        assert f"{name}=={carried[name]}" in lock
    # what the image has, or must not travel: torch and its CUDA stack, bitsandbytes' 60 MB wheel
    assert not {"torch", "triton", "bitsandbytes", "numpy", "pandas", "pyarrow", "jinja2"} & set(carried)
    # gpu_evidence.py's trainer_speed stage: TRL and what it needs beyond memfit, and Liger's kernels
    assert {"trl", "datasets", "dill", "multiprocess", "liger-kernel"} <= set(carried)
    assert f"trl=={carried['trl']}" in lock
