"""SLURM resources of one workflow job, derived from the target and the estimate.

The snakemake-executor-plugin-slurm turns these resource names into sbatch flags
(`nodes` -> --nodes, `gpu` -> --gpus, `gpu_model` -> --gpus=<model>:<n>, `gres` -> --gres,
`constraint` -> -C, `cpus_per_gpu`, `tasks` -> --ntasks, `mem_mb` -> --mem, `runtime` -> -t
minutes, `slurm_partition` -> -p, `slurm_account` -> -A; see the plugin's docs "Advanced
Resource Specifications" and its `submit_string.get_submit_command` / `utils.set_gres_string`).

`rule_resources` is what workflow/rules/common.smk hands every rule; how one job of several
nodes starts one launcher per node is memfit.train.launch (`per_node_srun`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memfit.units import MIB

# Host RAM beyond the estimator's per-node peak: the OS, the page cache of the dataset and
# the CUDA/NCCL host allocations the estimate does not model. 10 % plus 8 GiB (our choice).
MEM_MARGIN_PERCENT = 10
MEM_MARGIN_MB = 8 * 1024

# Rules that start ranks (memfit.train.launch): they get nodes, GPUs and memory from the estimate.
RANK_RULES = frozenset({"calibrate", "probe_candidate", "train", "verify_resume"})
# Wall time (minutes) when the config's slurm.runtime_min does not name the rule (our choice:
# training 48 h, a site's usual maximum; verify_resume repeats the tail of a run).
DEFAULT_RUNTIME_MIN = {
    "build_demo_model": 15,
    "prepare_data": 60,
    "estimate_candidates": 30,
    "calibrate": 60,
    "train": 2880,
    "verify_resume": 240,
}
DEFAULT_CPUS_PER_GPU = 8  # CPU cores per GPU (dataloader, optimizer offload); slurm.cpus_per_gpu


class SlurmConfigError(ValueError):
    """The `slurm:` section of the workflow config is missing or inconsistent."""


def calibrate_host_bytes(model_dir: str | Path) -> int:
    """Host RAM bound of the calibrate job: the size of the model's weight files. The calibration
    builds, saves and loads slices of at most 4 decoder layers (memfit.train.calibrate), never the
    whole model, so the whole model's size bounds what its ranks hold."""
    files = [p for p in Path(model_dir).glob("*") if p.suffix in (".safetensors", ".bin", ".pt")]
    return sum(p.stat().st_size for p in files)


def mem_mb(host_bytes: int) -> int:
    """--mem (MB per node) for a job whose estimated host peak per node is `host_bytes`
    (pinned offload buffers included, as estimate.Estimate.host_bytes counts them)."""
    if host_bytes < 0:
        raise SlurmConfigError(f"host_bytes must be >= 0, got {host_bytes}")
    return -(-host_bytes * (100 + MEM_MARGIN_PERCENT) // (100 * MIB)) + MEM_MARGIN_MB  # ceil, exact ints


def job_resources(
    *,
    num_gpus: int,
    num_nodes: int,
    gpu: str,
    host_bytes: int,
    runtime_min: int,
    cluster: Mapping[str, Any],
) -> dict[str, Any]:
    """Resources of one rank-running job (probe/train/verify_resume) on `num_nodes` x `num_gpus`
    `gpu` (`cpu`: `num_gpus` CPU ranks per node, no GPU requested).

    `cluster` is the config's `slurm:` mapping (may be empty): optional `partition`, `account`,
    `cpus_per_gpu` (default 8) and `gpu_types: {<memfit gpu name>: {gpu_model: .., constraint: ..}}`.
    Without `partition`/`account` the profile's default-resources (or the cluster's defaults) apply.

    GPUs: one node asks `--gpus=[<model>:]<n>` (the plugin's `gpu`/`gpu_model`). Several nodes ask
    `--gres=gpu[:<model>]:<n>` instead: sbatch's `--gpus` counts the whole job and lets SLURM
    spread it unevenly over the nodes, `--gres` counts per node (sbatch(1), --gpus and --gres).
    """
    if num_gpus < 1 or num_nodes < 1:
        raise SlurmConfigError(f"num_gpus and num_nodes must be >= 1, got {num_gpus} and {num_nodes}")
    gtype = (cluster.get("gpu_types") or {}).get(gpu) or {}
    res: dict[str, Any] = {"nodes": num_nodes}
    if gpu == "cpu":
        # CPU ranks: the plugin then asks --ntasks (default 1, which would shrink --nodes to 1)
        # and --cpus-per-task=threads; one task per node is one launcher per node.
        res["tasks"] = num_nodes
        res["gpu"] = 0
    elif num_nodes == 1:
        res["gpu"] = num_gpus
        if gtype.get("gpu_model"):
            res["gpu_model"] = str(gtype["gpu_model"])
        res["cpus_per_gpu"] = int(cluster.get("cpus_per_gpu", DEFAULT_CPUS_PER_GPU))
    else:
        model = f":{gtype['gpu_model']}" if gtype.get("gpu_model") else ""
        res["gres"] = f"gpu{model}:{num_gpus}"  # per node
        res["cpus_per_gpu"] = int(cluster.get("cpus_per_gpu", DEFAULT_CPUS_PER_GPU))
    if gpu != "cpu" and gtype.get("constraint"):
        res["constraint"] = str(gtype["constraint"])
    res["mem_mb"] = mem_mb(host_bytes)
    res["runtime"] = int(runtime_min)
    res.update(partition_account(cluster, gpu_job=gpu != "cpu"))
    return res


def local_gpu_slots(config: Mapping[str, Any], *, local_exec: bool, named: bool) -> int | None:
    """The `gpu` resource a run on one machine registers, or None to leave Snakemake's as it is.
    Each rank-running job asks for `gpu` = num_gpus (rule_resources), and Snakemake leaves a
    resource that `--resources` does not name unlimited: without this, two probes, or a probe and
    the calibration, would share the GPUs and time each other. None under a cluster executor (each
    job has its own GPUs) or when `--resources gpu=N` names it (`named`)."""
    if not local_exec or named:
        return None
    return int(config["num_gpus"])


def partition_account(cluster: Mapping[str, Any], gpu_job: bool = True) -> dict[str, str]:
    """`slurm_partition`/`slurm_account` from the config's `slurm:` mapping, when it names them:
    `partition` for GPU jobs, `cpu_partition` (default: `partition`) for jobs without GPUs."""
    out = {}
    partition = cluster.get("partition") if gpu_job else cluster.get("cpu_partition")
    partition = partition or cluster.get("partition")
    if partition:
        out["slurm_partition"] = str(partition)
    if cluster.get("account"):
        out["slurm_account"] = str(cluster["account"])
    return out


def runtime_min(config: Mapping[str, Any], rule: str) -> int:
    """Wall time (minutes) of one job of `rule`: `slurm.runtime_min.<rule>` from the config, else
    DEFAULT_RUNTIME_MIN; a probe's default follows `probe.timeout_s` (+ 10 min to start)."""
    given = ((config.get("slurm") or {}).get("runtime_min") or {}).get(rule)
    if given is not None:
        return int(given)
    if rule == "probe_candidate":
        timeout_s = float((config.get("probe") or {}).get("timeout_s", 900))
        return -(-int(timeout_s) // 60) + 10
    if rule not in DEFAULT_RUNTIME_MIN:
        raise SlurmConfigError(f"no runtime for rule {rule!r}: set slurm.runtime_min.{rule}")
    return DEFAULT_RUNTIME_MIN[rule]


def rule_resources(config: Mapping[str, Any], rule: str, gpu: str, host_bytes: int | None = None) -> dict[str, Any]:
    """Every SLURM resource of one job of `rule` on the `{gpu}` wildcard `gpu`.

    Rank-running rules (RANK_RULES) get `job_resources` from `num_gpus`, `num_nodes` and the
    estimated host RAM per node (`host_bytes`); the others (data, estimate, demo model) get
    their runtime and the config's partition/account, their memory from the profile.
    """
    cluster = config.get("slurm") or {}
    if rule not in RANK_RULES:
        return {"runtime": runtime_min(config, rule), **partition_account(cluster, gpu_job=False)}
    if host_bytes is None:
        raise SlurmConfigError(f"rule {rule}: host_bytes (the estimate's host RAM) is needed")
    return job_resources(
        num_gpus=int(config["num_gpus"]),
        # the calibration measures one node (memfit.train.calibrate)
        num_nodes=1 if rule == "calibrate" else int(config.get("num_nodes", 1)),
        gpu=gpu,
        host_bytes=host_bytes,
        runtime_min=runtime_min(config, rule),
        cluster=cluster,
    )


def probe_host_bytes(candidates_json: str | Path, cand_id: str) -> int:
    """Host RAM per node the probed candidate is estimated to need (its row in candidates.json)."""
    rows = json.loads(Path(candidates_json).read_text())["rows"]
    row = next((r for r in rows if r["id"] == cand_id), None)
    if row is None:
        raise SlurmConfigError(f"{candidates_json}: no candidate {cand_id!r}")
    return int(row.get("host_bytes", 0))


def run_host_bytes(run_json: str | Path) -> int:
    """Host RAM per node of the selected run whose run.json is `run_json`: selected.json beside it
    (written with it by select_config), else the worst case over candidates.json beside it."""
    Path(run_json).open().close()  # FileNotFoundError naming the input: Snakemake defers the value
    run_dir = Path(run_json).parent
    rows = []
    table = run_dir / "candidates.json"
    if table.exists():
        rows = json.loads(table.read_text())["rows"]
    return host_bytes_of(run_dir / "selected.json", rows)


def host_bytes_of(selected_json: Path | None, estimates: list[Mapping[str, Any]]) -> int:
    """Host RAM per node to request: the chosen candidate's estimate when select has run
    (`selected.json` exists), else the worst case over all estimated candidates, so a job
    submitted before select is decided never asks for too little."""
    if selected_json is not None and Path(selected_json).exists():
        sel = json.loads(Path(selected_json).read_text())
        chosen = sel.get("selected") or {}  # pipeline.select writes {"selected": {..., "host_bytes"}}
        if chosen.get("host_bytes") is not None:
            return int(chosen["host_bytes"])
    if not estimates:
        raise SlurmConfigError("no estimates to derive host RAM from")
    return max(int(e.get("host_bytes", 0)) for e in estimates)


# -- conda --------------------------------------------------------------------------------------
# The slurm profile runs every rule in the workflow's conda env (`use-conda: true`). Snakemake asks
# `conda info` while it builds the DAG, even for a dry run that creates no env: without conda a
# plan-only preview (`snakemake -n --profile slurm`) would fail on "conda: command not found".
NO_CONDA_PROFILE = "slurm/no-conda"  # a workflow profile that turns use-conda off (docs/slurm.md)
_noted: list[str] = []


class NoCondaError(RuntimeError):
    """A real run with conda deployment on and no conda to run it."""


def conda_env(env_file: str, *, uses_conda: bool, dryrun: bool, conda_found: bool) -> str | None:
    """The conda directive of every rule: `env_file`, except in a dry run with no conda on PATH,
    which lists the jobs without their env (a dry run creates none) after a note saying so. A real
    run without conda stops (NoCondaError) while the workflow is read, before the DAG and any job,
    with what to do instead."""
    if not uses_conda or conda_found:
        return env_file
    where = env_file.rsplit("/", 2)[-2:]
    env = "/".join(where)
    if dryrun:
        if not _noted:
            _noted.append(env)
            print(
                f"memfit: conda is not on PATH; this dry run lists the jobs without their conda env "
                f"({env}, use-conda: true in the slurm profile). A real run needs conda here and on "
                f"the nodes, or your own environment: add --workflow-profile {NO_CONDA_PROFILE}",
                file=sys.stderr,
            )
        return None
    raise NoCondaError(
        f"conda is not on PATH, and this run deploys every rule in the conda env {env} "
        f"(use-conda: true in the slurm profile, or --use-conda/--sdm conda). Install conda here and "
        f"on the nodes, or run in your own environment (memfit installed): under --profile slurm add "
        f"--workflow-profile {NO_CONDA_PROFILE}, elsewhere leave out --use-conda; a dry run (-n) "
        f"needs no conda"
    )
