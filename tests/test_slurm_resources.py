"""Per-job SLURM resources derived from the target and the estimate, not hand-edited."""

from __future__ import annotations

import json

import pytest

from memfit.slurm import SlurmConfigError, host_bytes_of, job_resources, mem_mb
from memfit.units import GIB

CLUSTER = {
    "partition": "gpu",
    "account": "proj1",
    "cpus_per_gpu": 12,
    "gpu_types": {
        "H100-80GB": {"gpu_model": "h100", "constraint": "h100"},
        "RTX-4090": {"gpu_model": "rtx4090"},
    },
}


def test_mem_covers_the_estimate_plus_margin():
    assert mem_mb(0) == 8 * 1024
    assert mem_mb(100 * GIB) == 110 * 1024 + 8 * 1024
    with pytest.raises(SlurmConfigError):
        mem_mb(-1)


def test_72b_on_four_nodes_of_eight_h100():
    res = job_resources(
        num_gpus=8,
        num_nodes=4,
        gpu="H100-80GB",
        host_bytes=900 * GIB,
        runtime_min=2880,
        cluster=CLUSTER,
    )
    assert res["nodes"] == 4 and res["gpu"] == 8 and res["tasks_per_node"] == 1
    assert res["gpu_model"] == "h100" and res["constraint"] == "h100"
    assert res["mem_mb"] == mem_mb(900 * GIB) and res["mem_mb"] > 900 * 1024
    assert (
        res["runtime"] == 2880
        and res["slurm_partition"] == "gpu"
        and res["slurm_account"] == "proj1"
    )
    assert res["cpus_per_gpu"] == 12


def test_8b_on_one_rtx4090_has_no_constraint_and_partition_is_required():
    res = job_resources(
        num_gpus=1,
        num_nodes=1,
        gpu="RTX-4090",
        host_bytes=20 * GIB,
        runtime_min=30,
        cluster=CLUSTER,
    )
    assert (
        res["nodes"] == 1
        and res["gpu"] == 1
        and res["gpu_model"] == "rtx4090"
        and "constraint" not in res
    )
    with pytest.raises(SlurmConfigError, match="slurm.partition"):
        job_resources(num_gpus=1, num_nodes=1, gpu="X", host_bytes=0, runtime_min=1, cluster={})


def test_host_ram_from_selected_else_worst_estimate(tmp_path):
    ests = [{"host_bytes": 10 * GIB}, {"host_bytes": 70 * GIB}]
    sel = tmp_path / "selected.json"
    assert host_bytes_of(sel, ests) == 70 * GIB  # select has not run: worst case
    sel.write_text(json.dumps({"selected": {"id": "c3", "host_bytes": 10 * GIB}}))
    assert host_bytes_of(sel, ests) == 10 * GIB
