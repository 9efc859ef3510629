"""The trace workers' process (memfit.estimate.trace.trace_children): preloaded once by a fork server,
so every worker forked from it starts with torch, transformers and peft imported (about 7 CPU
seconds a process, paid once per estimating process instead of once per child).

Imported in the fork server only: its stderr goes to /dev/null (transformers' notices of missing
optional kernels would otherwise reach the user's terminal from every worker) and it runs torch on
one thread (fake tensors do no arithmetic). A worker's error comes back as text with its result.
"""

from __future__ import annotations

import os
import time
import warnings

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


def run(task: tuple[int, ModelArch, dict, int]) -> tuple[int, int, dict | None, float, str]:
    """One shape's `layers`-layer model (trace_step.trace_layers): (its index, the layers, the
    measures, seconds, "" or the error)."""
    index, arch, key, layers = task
    t0 = time.perf_counter()
    try:
        r = trace_step.trace_layers(arch, key, layers)
    except Exception as exc:  # noqa: BLE001 - reported by the estimating process as a TraceError
        error = str(exc) if isinstance(exc, errors.TraceError) else f"{type(exc).__name__}: {exc}"
        return index, layers, None, 0.0, error
    return index, layers, r, time.perf_counter() - t0, ""
