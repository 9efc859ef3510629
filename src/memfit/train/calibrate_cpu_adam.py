"""The calibrate rule's DeepSpeedCPUAdam figure (memfit.train.calibrate, `cpu_adam`): what one host
optimizer step costs per parameter on this machine, measured only when a candidate offloads its
optimizer (`offload_optimizer: cpu`); memfit.estimate.time.costs prices an offloaded step from it."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from memfit.space import Candidate

# DeepSpeedCPUAdam's block: 2**24 fp32 parameters, 64 MiB per tensor (parameter, gradient, exp_avg,
# exp_avg_sq: 256 MiB a rank), far beyond any CPU cache, so the step streams from DRAM as a real
# model's partition does (benchmarks/bench_cpu_adam.py measured 5.4e8 params/s per core at 50M
# parameters and 7.6e8 at 10M, in cache, on one AVX-512 Xeon core).
CPU_ADAM_BLOCK = 2**24


def cpu_adam_seconds(params: int, reps: int) -> float:
    """Median seconds of one DeepSpeedCPUAdam step (deepspeed.ops.adam, the C++ op DeepSpeed runs
    for `offload_optimizer: cpu`, AdamW mode) over one fp32 parameter of `params` elements with an
    fp32 gradient, after one warm-up step (it allocates exp_avg and exp_avg_sq), on this
    process's threads (the op's OpenMP loop uses them)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    p = torch.nn.Parameter(torch.randn(params, dtype=torch.float32))
    p.grad = torch.randn(params, dtype=torch.float32)
    opt = DeepSpeedCPUAdam([p], lr=1e-4, weight_decay=0.0, adamw_mode=True)
    opt.step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    del opt, p
    return float(statistics.median(times))


def wants_cpu_adam(candidates: dict[str, list[Candidate]]) -> bool:
    """Whether the search space has a candidate whose optimizer steps on the host (DeepSpeedCPUAdam)."""
    return any(c.offload_optimizer == "cpu" for cands in candidates.values() for c in cands)


def cpu_adam_figure(seconds: float) -> dict[str, Any]:
    """The calibration's `cpu_adam` record from the slowest rank's median step of one block."""
    return {
        "block_params": CPU_ADAM_BLOCK,
        "dtype": "fp32",
        "seconds": seconds,  # the slowest rank's median step
        "params_per_s_per_rank": CPU_ADAM_BLOCK / seconds,
        "threads_per_rank": torch.get_num_threads(),
    }
