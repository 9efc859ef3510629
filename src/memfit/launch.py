"""Start every rank of a run on this node and report how it ended.

`torch.distributed.run --standalone` picks a free rendezvous port, so several runs
(probes) can share a machine. DeepSpeed on the CPU needs `DS_ACCELERATOR=cpu`, set
here when no CUDA device is visible.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch


def nproc_default() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def launch_env(threads_per_rank: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    # DeepSpeed's JIT-compiled ops live with the environment that built them (`make ops`).
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    if threads_per_rank:
        env["OMP_NUM_THREADS"] = str(threads_per_rank)
    return env


def command(config: Path, nproc: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "memfit.cli",
        "train",
        "--config",
        str(config),
    ]


def launch(config: Path, nproc: int, log: Path | None = None, timeout_s: float | None = None) -> int:
    """Run all ranks; stdout/stderr go to `log` (appended) or are inherited. Returns the exit code."""
    cmd = command(config, nproc)
    threads = max(1, (os.cpu_count() or 1) // nproc) if not torch.cuda.is_available() else None
    if log is None:
        return subprocess.run(cmd, env=launch_env(threads), timeout=timeout_s).returncode
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        return subprocess.run(cmd, env=launch_env(threads), stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s).returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="memfit launch", description="Start all ranks of a run on this node.")
    ap.add_argument("--config", required=True, type=Path, help="run config JSON")
    ap.add_argument("--nproc", type=int, default=nproc_default(), help="ranks (GPUs; 2 on the CPU)")
    args = ap.parse_args(argv)
    return launch(args.config, args.nproc)
