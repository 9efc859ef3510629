"""The workflow's rank start-up server: on the CPU accelerator on one machine, the ranks of every
probe, calibration, training run and resume check fork from one process that imported torch,
DeepSpeed and transformers once (memfit.train.rank_server), instead of each rank importing them
again (about 5 s of a demo launch's 9-11 s; the demo makes about 15 launches of 2 ranks).

Started by the Snakefile's `onstart` and stopped by its `onsuccess`/`onerror` (and at exit); the
server also exits by itself when the Snakemake process is gone. Not started:
- under a cluster executor (`--profile slurm`): each job's ranks run in its own allocation;
- for GPUs: a forked CUDA context is unusable, and a GPU run's start-up is a small part of it;
- for a plan-only run (nothing launches ranks);
- when MEMFIT_RANK_SERVER is set already: a path (the test suite's server) is used as it is, and
  `off` starts every rank as its own interpreter (`memfit launch`'s behaviour outside the workflow).
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from typing import Any

from memfit.train.launch import start_rank_server as start_server
from memfit.train.rank_server import ENV

_RUNNING: dict[str, Any] = {}


def wanted(config: Mapping[str, Any], *, local_exec: bool, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this workflow run starts a rank server (module docstring)."""
    if ENV in environ or not local_exec or config.get("plan_only"):
        return False
    return {str(g) for g in config.get("gpus") or []} == {"cpu"}


def start(config: Mapping[str, Any], *, local_exec: bool) -> str | None:
    """Start the server (when `wanted`) and point this process's MEMFIT_RANK_SERVER at it, so
    every job Snakemake starts from here inherits it; its socket path, or None."""
    if not wanted(config, local_exec=local_exec) or _RUNNING:
        return None
    folder = tempfile.mkdtemp(prefix="memfit-ranks-")  # a short path: a Unix socket's is at most 107 bytes
    path = os.path.join(folder, "ranks.sock")
    log = open(os.path.join(folder, "server.log"), "wb")  # noqa: SIM115 - closed by stop()
    proc = start_server(path, int(config.get("num_gpus") or 1), stdout=log)
    _RUNNING.update(proc=proc, log=log, folder=folder)
    os.environ[ENV] = path
    atexit.register(stop)
    return path


def stop() -> None:
    """Stop the server `start` started (nothing if none): its forked ranks die with it."""
    if not _RUNNING:
        return
    proc: subprocess.Popen = _RUNNING.pop("proc")
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    _RUNNING.pop("log").close()
    shutil.rmtree(_RUNNING.pop("folder"), ignore_errors=True)
    os.environ.pop(ENV, None)
