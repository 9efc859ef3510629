"""Per-job SLURM resources derived from the target and the estimate, not hand-edited."""

from __future__ import annotations

import json

import pytest

from memfit.train.launch import per_node_srun, srun_env
from memfit.units import GIB
from memfit.workflow.slurm import (
    SlurmConfigError,
    host_bytes_of,
    job_resources,
    local_gpu_slots,
    mem_mb,
    rule_resources,
    run_host_bytes,
    runtime_min,
)

CLUSTER = {
    "partition": "gpu",
    "account": "proj1",
    "cpus_per_gpu": 12,
    "gpu_types": {
        "h100-80gb": {"gpu_model": "h100", "constraint": "h100"},
        "rtx4090": {"gpu_model": "rtx4090"},
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
        gpu="h100-80gb",
        host_bytes=900 * GIB,
        runtime_min=2880,
        cluster=CLUSTER,
    )
    # 8 GPUs on each node: --gres counts per node (sbatch --gpus would count the whole job)
    assert res["nodes"] == 4 and res["gres"] == "gpu:h100:8" and "gpu" not in res
    assert res["constraint"] == "h100" and "tasks" not in res
    assert res["mem_mb"] == mem_mb(900 * GIB) and res["mem_mb"] > 900 * 1024
    assert res["runtime"] == 2880 and res["slurm_partition"] == "gpu" and res["slurm_account"] == "proj1"
    assert res["cpus_per_gpu"] == 12


def test_8b_on_one_rtx4090_asks_gpus_of_its_model_and_no_constraint():
    res = job_resources(
        num_gpus=1,
        num_nodes=1,
        gpu="rtx4090",
        host_bytes=20 * GIB,
        runtime_min=30,
        cluster=CLUSTER,
    )
    assert res["nodes"] == 1 and res["gpu"] == 1 and res["gpu_model"] == "rtx4090"
    assert "constraint" not in res and "gres" not in res


def test_without_a_slurm_section_the_profile_decides_partition_and_account():
    res = job_resources(num_gpus=2, num_nodes=1, gpu="a100-80gb", host_bytes=0, runtime_min=1, cluster={})
    assert "slurm_partition" not in res and "slurm_account" not in res and "gpu_model" not in res
    assert res["gpu"] == 2 and res["cpus_per_gpu"] == 8
    with pytest.raises(SlurmConfigError):
        job_resources(num_gpus=0, num_nodes=1, gpu="x", host_bytes=0, runtime_min=1, cluster={})


def test_cpu_ranks_ask_one_task_per_node_and_no_gpu():
    # the plugin's default --ntasks=1 would shrink a 2-node request to one node
    res = job_resources(
        num_gpus=2,
        num_nodes=2,
        gpu="cpu",
        host_bytes=GIB,
        runtime_min=5,
        cluster={"partition": "gpu", "cpu_partition": "cpu"},
    )
    assert res["nodes"] == 2 and res["tasks"] == 2 and res["gpu"] == 0
    assert res["slurm_partition"] == "cpu" and "cpus_per_gpu" not in res


def test_runtime_per_rule_from_config_else_defaults_and_probe_timeout():
    cfg = {"probe": {"timeout_s": 1200}, "slurm": {"runtime_min": {"train": 600}}}
    assert runtime_min(cfg, "train") == 600
    assert runtime_min(cfg, "verify_resume") == 240
    assert runtime_min(cfg, "probe_candidate") == 20 + 10
    assert runtime_min({"probe": {"timeout_s": 61}}, "probe_candidate") == 2 + 10
    with pytest.raises(SlurmConfigError, match="slurm.runtime_min.report"):
        runtime_min(cfg, "report")


def test_rule_resources_of_data_rules_are_runtime_and_cpu_partition():
    cfg = {"num_gpus": 8, "slurm": {"partition": "gpu", "cpu_partition": "cpu", "account": "a"}}
    assert rule_resources(cfg, "prepare_data", "h100-80gb") == {
        "runtime": 60,
        "slurm_partition": "cpu",
        "slurm_account": "a",
    }
    with pytest.raises(SlurmConfigError, match="host_bytes"):
        rule_resources(cfg, "train", "h100-80gb")


def test_run_host_bytes_names_the_missing_run_json_so_snakemake_defers(tmp_path):
    run = tmp_path / "run.json"
    with pytest.raises(FileNotFoundError) as e:
        run_host_bytes(run)
    assert e.value.filename == str(run)
    run.write_text("{}")
    (tmp_path / "candidates.json").write_text(json.dumps({"rows": [{"host_bytes": 5 * GIB}]}))
    assert run_host_bytes(run) == 5 * GIB
    (tmp_path / "selected.json").write_text(json.dumps({"selected": {"host_bytes": GIB}}))
    assert run_host_bytes(run) == GIB


def test_per_node_srun_only_for_a_multi_node_job_started_as_one_task():
    assert per_node_srun(1, {"SLURM_JOB_ID": "7"}) is None
    assert per_node_srun(2, {}) is None  # no allocation: launch asks for a rendezvous
    # the plugin's jobstep: one task of a one-node step on the first node
    one_task = {"SLURM_JOB_ID": "7", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1"}
    cmd = per_node_srun(2, one_task)
    assert cmd[0] == "srun" and "--overlap" in cmd and "--nodes=2" in cmd
    assert "--ntasks-per-node=1" in cmd and "--ntasks=2" in cmd and "--jobid=7" in cmd
    # already one launcher per node (launch.sh's srun): no second srun
    per_node = {"SLURM_JOB_ID": "7", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2"}
    assert per_node_srun(2, per_node) is None


def test_host_ram_from_selected_else_worst_estimate(tmp_path):
    ests = [{"host_bytes": 10 * GIB}, {"host_bytes": 70 * GIB}]
    sel = tmp_path / "selected.json"
    assert host_bytes_of(sel, ests) == 70 * GIB  # select has not run: worst case
    sel.write_text(json.dumps({"selected": {"id": "c3", "host_bytes": 10 * GIB}}))
    assert host_bytes_of(sel, ests) == 10 * GIB


def test_config_slurm_section_is_validated_naming_the_key():
    from pathlib import Path

    from memfit.workflow.config import ConfigError, WorkflowConfig, load_yaml

    root = Path(__file__).resolve().parents[1]
    raw = load_yaml(root / "config" / "cluster-example.yaml")
    raw["plan_only"] = True  # no weights needed to validate
    raw["slurm"] = {"partition": "gpu", "gpu_types": {"h100-80gb": {"gpu_model": "h100"}}}
    assert WorkflowConfig.load(raw).slurm["partition"] == "gpu"
    raw["slurm"]["gpu_types"]["h100-80gbb"] = {"gpu_model": "h100"}
    with pytest.raises(ConfigError, match=r"slurm.gpu_types.h100-80gbb: not a GPU name"):
        WorkflowConfig.load(raw)
    raw["slurm"] = {"runtime_min": {"trian": 5}}
    with pytest.raises(ConfigError, match=r"slurm.runtime_min.*trian"):
        WorkflowConfig.load(raw)


def test_srun_env_drops_the_one_node_step_it_runs_in():
    # what the plugin's `srun -n1` step hands its task on a 2-node job (SLURM 22.05)
    step = {
        "SLURM_JOB_ID": "10",
        "SLURM_CONF": "/etc/slurm/slurm.conf",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NODELIST": "memfit-n1",
        "SLURM_STEP_NUM_NODES": "1",
        "SRUN_DEBUG": "3",
        "PATH": "/usr/bin",
    }
    assert srun_env(step) == {
        "SLURM_JOB_ID": "10",
        "SLURM_CONF": "/etc/slurm/slurm.conf",
        "PATH": "/usr/bin",
    }


def test_on_one_machine_rank_rules_run_one_at_a_time_unless_resources_say_otherwise():
    """A workstation run registers gpu = num_gpus, which each rank-running rule asks for whole, so
    two probes never share the GPU; a cluster executor or `--resources gpu=N` leaves it alone."""
    config = {"num_gpus": 1, "num_nodes": 1}
    slots = local_gpu_slots(config, local_exec=True, named=False)
    for rule in ("calibrate", "probe_candidate", "train", "verify_resume"):
        assert rule_resources(config, rule, "h200", host_bytes=16 * GIB)["gpu"] == slots == 1
    assert local_gpu_slots(config, local_exec=False, named=False) is None
    assert local_gpu_slots(config, local_exec=True, named=True) is None


def test_snakemake_schedules_jobs_asking_the_registered_gpus_one_after_the_other(tmp_path):
    """What the Snakefile does with local_gpu_slots, in a two-job workflow: the jobs do not overlap
    although --cores would let both run."""
    import subprocess
    import sys
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src"
    (tmp_path / "Snakefile").write_text(
        f"""import sys
sys.path.insert(0, {str(src)!r})
from memfit.workflow.slurm import local_gpu_slots
slots = local_gpu_slots({{"num_gpus": 1}}, local_exec=workflow.local_exec, named="gpu" in workflow.global_resources)
if slots is not None:
    workflow.register_resource("gpu", slots)
rule all:
    input: "a", "b"
rule job:
    output: "{{x}}"
    resources: gpu=1
    shell: "date +%s.%N > {{output}}.start; sleep 1; date +%s.%N > {{output}}"
"""
    )
    subprocess.run([sys.executable, "-m", "snakemake", "--cores", "4", "-q"], cwd=tmp_path, check=True)
    spans = sorted((float((tmp_path / f"{x}.start").read_text()), float((tmp_path / x).read_text())) for x in "ab")
    assert spans[0][1] <= spans[1][0], spans
