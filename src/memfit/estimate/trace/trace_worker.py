"""The trace workers' process (memfit.estimate.trace.trace_children): preloaded once by a fork server,
so every worker forked from it starts with torch, transformers and peft imported (about 7 CPU
seconds a process, paid once per estimating process instead of once per child).

Imported in the fork server only: its stderr goes to /dev/null (transformers' notices of missing
optional kernels would otherwise reach the user's terminal from every worker) and it runs torch on
one thread (fake tensors do no arithmetic). A worker's error comes back as text with its result.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import warnings
from multiprocessing.connection import wait

os.environ["OMP_NUM_THREADS"] = "1"  # this process and the workers forked from it only
os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
warnings.filterwarnings("ignore")

import peft  # noqa: E402, F401 - the point of this module: imported once, before the fork
import torch  # noqa: E402
import transformers  # noqa: E402, F401

from memfit.estimate import errors  # noqa: E402
from memfit.estimate.models.arch import ModelArch  # noqa: E402
from memfit.estimate.trace import trace_step  # noqa: E402

torch.set_num_threads(1)


def exit_with_parent() -> None:
    """A worker's initializer (trace_children): ends this worker as soon as the estimating process
    that started it is gone, however it went (SIGTERM, SIGKILL, a crash), busy or idle. Otherwise
    it waits on its task queue forever: every worker holds that queue's write end, so none reads
    EOF. (PR_SET_PDEATHSIG, prctl(2), cannot serve: a worker's parent is the fork server, which
    lives until the last worker is gone, each holding its "alive" pipe: forkserver.main.)
    multiprocessing gives a child a sentinel of the process that started it: the read end of a
    pipe whose write end only that process holds (popen_forkserver.Popen._launch keeps a dup of
    it; BaseProcess._bootstrap hands the read end to parent_process()), at EOF once it died."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)  # nothing to save: its result would have nowhere to go

    threading.Thread(target=watch, name="memfit-exit-with-parent", daemon=True).start()


def run(task: tuple[int, ModelArch, dict]) -> tuple[int, dict | None, float, str]:
    """One shape: (its index, the 1- and 2-layer measures, seconds, "" or the error)."""
    index, arch, key = task
    try:
        r = trace_step.trace_keys(arch, [key])[0]
    except Exception as exc:  # noqa: BLE001 - reported by the estimating process as a TraceError
        return index, None, 0.0, str(exc) if isinstance(exc, errors.TraceError) else f"{type(exc).__name__}: {exc}"
    return index, r["runs"], float(r["seconds"]), ""
