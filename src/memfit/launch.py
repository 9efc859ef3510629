"""Start every rank of a run on this node and report how it ended.

`torch.distributed.run --standalone` picks a free rendezvous port, so several runs
(probes) can share a machine. DeepSpeed on the CPU needs `DS_ACCELERATOR=cpu`, set
here when no CUDA device is visible.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
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
    """Run all ranks; stdout/stderr go to `log` (appended) or are inherited. Returns the exit code.

    SIGTERM and SIGUSR1 sent to this process (SLURM's warning before the wall-time kill) are
    forwarded to the ranks, which checkpoint at the end of the current step and exit.
    """
    cmd = command(config, nproc)
    threads = max(1, (os.cpu_count() or 1) // nproc) if not torch.cuda.is_available() else None
    out = None
    if log is not None:
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        out = open(log, "a")  # noqa: SIM115 - closed below
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
    proc = subprocess.Popen(cmd, env=launch_env(threads), stdout=out, stderr=subprocess.STDOUT if out else None)
    forwarded = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            # torchrun turns SIGTERM into SIGTERM to every rank (then SIGKILL after 30 s);
            # it has no handler for SIGUSR1, so that one is forwarded as SIGTERM too.
            forwarded[sig] = signal.signal(sig, lambda _signum, _frame: proc.send_signal(signal.SIGTERM))
    try:
        rc = proc.wait(timeout=timeout_s)
        if rc != 0 and _preempted(config):
            from memfit.train import PREEMPTED_EXIT_CODE

            return PREEMPTED_EXIT_CODE  # torchrun exits 1 after forwarding the signal; the ranks saved
        return rc
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    finally:
        for sig, handler in forwarded.items():
            signal.signal(sig, handler)
        if out is not None:
            out.close()


def _preempted(config: Path) -> bool:
    import json

    from memfit.train import PREEMPTED_MARKER

    out_dir = json.loads(Path(config).read_text()).get("out_dir")
    return bool(out_dir) and (Path(out_dir) / PREEMPTED_MARKER).exists()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="memfit launch", description="Start all ranks of a run on this node.")
    ap.add_argument("--config", required=True, type=Path, help="run config JSON")
    ap.add_argument("--nproc", type=int, default=nproc_default(), help="ranks (GPUs; 2 on the CPU)")
    args = ap.parse_args(argv)
    if args.nproc < 1:
        ap.error(f"--nproc must be >= 1, got {args.nproc}")
    return launch(args.config, args.nproc)
