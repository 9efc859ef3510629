"""One rank's entry point: `python -m memfit.cli train --config run.json` (what `memfit launch`
starts once per rank) runs `main`, which runs `run_rank`: the rank dies with its
parent, stops on SLURM's signals at the next step, and records an out-of-memory as a marker file
and exit code (`OOM_EXIT_CODE`) instead of a crash."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

import torch

from memfit.atomic import write_json_atomic
from memfit.train import determinism
from memfit.train import dist as dist_env
from memfit.train.loop import Run, request_stop
from memfit.train.run_config import OOM_EXIT_CODE, RunConfig
from memfit.train.startup import defer_torch_compile, memoize_cpu_info


def _die_with_parent() -> None:
    """If the launcher (or, across nodes, torchrun, which starts every rank in a session of its
    own) is SIGKILLed, the ranks would train on as orphans and race a resumed run for the
    checkpoint directory. PR_SET_PDEATHSIG makes the kernel SIGKILL this rank when its parent
    dies (prctl(2), Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1  # <linux/prctl.h>
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def oom_record(run: Run) -> dict[str, Any]:
    """Where an OOM happened: the phase, and (on the cpu capacity) the live and capacity bytes."""
    tracker = getattr(run, "tracker", None)
    if tracker is not None and tracker.oom is not None:
        return {k: tracker.oom[k] for k in ("phase", "op", "live_bytes", "capacity_bytes")}
    rec: dict[str, Any] = {"phase": getattr(run, "oom_phase", "setup")}
    if torch.cuda.is_available():  # CUDA raised: what its allocator held at that moment
        rec["live_bytes"] = int(torch.cuda.memory_allocated())
        rec["capacity_bytes"] = int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return rec


def run_rank(cfg: RunConfig) -> dict[str, Any]:
    _die_with_parent()
    memoize_cpu_info()
    defer_torch_compile()
    if cfg.expandable_segments:
        # Read by the CUDA caching allocator at its first allocation, so set before any CUDA call.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if cfg.deterministic:  # before the process group: ProcessGroupNCCL reads it when it is made
        determinism.enable()
    if not cfg.probe_steps:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, request_stop)
    dist_env.init_distributed()
    run = Run(cfg)
    try:
        run.setup()
        return run.probe() if cfg.probe_steps else run.fit()
    except torch.OutOfMemoryError as e:
        marker = Path(cfg.out_dir) / f"oom.rank{run.rank}.json"
        marker.parent.mkdir(parents=True, exist_ok=True)
        # the training step it happened in (or after, for evaluation and checkpoint save): the fallback's oom_step
        rec = {"rank": run.rank, "error": str(e)[:2000], "step": run.step_now, **oom_record(run)}
        write_json_atomic(marker, rec)
        raise SystemExit(OOM_EXIT_CODE) from e


def main(argv: list[str] | None = None) -> NoReturn:
    import warnings

    # torch.distributed deprecation notices that DeepSpeed triggers on every collective.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*|.*reduce_scatter_tensor.*")
    ap = argparse.ArgumentParser(
        prog="memfit train", description="Run one training rank (use `memfit launch` for all)."
    )
    ap.add_argument("--config", required=True, help="run config JSON (RunConfig fields)")
    args = ap.parse_args(argv)
    cfg = RunConfig.load(args.config)
    summary = run_rank(cfg)
    if dist_env.rank() == 0:
        name = "probe.rank0.json" if cfg.probe_steps else "summary.json"
        write_json_atomic(Path(cfg.out_dir) / name, summary)
    dist_env.finish()
    _exit_now()


def _exit_now() -> NoReturn:
    """End a rank that finished: everything it writes is written (files closed, atomically
    renamed), so skip the interpreter's teardown of torch, DeepSpeed and gloo. That teardown took
    0.87 s of a 7.7 s demo-model run (measured 2026-11-26, 2 CPU ranks, tests/deepspeed_runs.py
    `base_run`; 0.04 s with this exit), and it is where gloo's worker threads were once torn down
    still holding work ("terminate called without an active exception", SIGABRT after a run that
    had finished: pytorch/pytorch#190489)."""
    import ctypes
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).fflush(None)  # C/C++ stdio buffers too (DeepSpeed's and gloo's messages)
    os._exit(0)
