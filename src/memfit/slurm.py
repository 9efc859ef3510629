"""SLURM resources of one workflow job, derived from the target and the estimate.

The snakemake-executor-plugin-slurm turns these resource names into sbatch flags
(`nodes` -> --nodes, `gpu` -> --gpus, `gpu_model` -> --gpus=<model>:<n>, `constraint`,
`cpus_per_gpu`, `mem_mb` -> --mem, `runtime` -> -t minutes, `slurm_partition`,
`slurm_account`; see the plugin's docs "Advanced Resource Specifications").
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memfit.units import MIB

# Host RAM beyond the estimator's per-node peak: the OS, the page cache of the dataset and
# the CUDA/NCCL host allocations the estimate does not model. 10 % plus 8 GiB (our choice).
MEM_MARGIN_PERCENT = 10
MEM_MARGIN_MB = 8 * 1024


class SlurmConfigError(ValueError):
    """The `slurm:` section of the workflow config is missing or inconsistent."""


def mem_mb(host_bytes: int) -> int:
    """--mem (MB per node) for a job whose estimated host peak per node is `host_bytes`
    (pinned offload buffers included, as estimate.Estimate.host_bytes counts them)."""
    if host_bytes < 0:
        raise SlurmConfigError(f"host_bytes must be >= 0, got {host_bytes}")
    return (
        -(-host_bytes * (100 + MEM_MARGIN_PERCENT) // (100 * MIB)) + MEM_MARGIN_MB
    )  # ceil, exact ints


def job_resources(
    *,
    num_gpus: int,
    num_nodes: int,
    gpu: str,
    host_bytes: int,
    runtime_min: int,
    cluster: Mapping[str, Any],
) -> dict[str, Any]:
    """Resources of one GPU job (probe/train/verify_resume) on `num_nodes` x `num_gpus` `gpu`.

    `cluster` is the config's `slurm:` mapping: `partition` (required), optional `account`,
    `cpus_per_gpu` (default 8) and `gpu_types: {<memfit gpu name>: {gpu_model: .., constraint: ..}}`.
    """
    if num_gpus < 1 or num_nodes < 1:
        raise SlurmConfigError(
            f"num_gpus and num_nodes must be >= 1, got {num_gpus} and {num_nodes}"
        )
    if "partition" not in cluster:
        raise SlurmConfigError("config key slurm.partition is required for SLURM resources")
    res: dict[str, Any] = {
        "nodes": num_nodes,
        "gpu": num_gpus,  # per node, as the plugin passes it to --gpus (one srun task per node)
        "tasks_per_node": 1,  # one torchrun launcher per node (memfit.launch)
        "cpus_per_gpu": int(cluster.get("cpus_per_gpu", 8)),
        "mem_mb": mem_mb(host_bytes),
        "runtime": int(runtime_min),
        "slurm_partition": str(cluster["partition"]),
    }
    if cluster.get("account"):
        res["slurm_account"] = str(cluster["account"])
    gtype = (cluster.get("gpu_types") or {}).get(gpu, {})
    for key in ("gpu_model", "constraint"):
        if gtype.get(key):
            res[key] = str(gtype[key])
    return res


def host_bytes_of(selected_json: Path | None, estimates: list[Mapping[str, Any]]) -> int:
    """Host RAM per node to request: the chosen candidate's estimate when select has run
    (`selected.json` exists), else the worst case over all estimated candidates, so a job
    submitted before select is decided never asks for too little."""
    if selected_json is not None and Path(selected_json).exists():
        sel = json.loads(Path(selected_json).read_text())
        chosen = (
            sel.get("selected") or {}
        )  # pipeline.select writes {"selected": {..., "host_bytes"}}
        if chosen.get("host_bytes") is not None:
            return int(chosen["host_bytes"])
    if not estimates:
        raise SlurmConfigError("no estimates to derive host RAM from")
    return max(int(e.get("host_bytes", 0)) for e in estimates)
