"""The sbatch command line of every job of a GPU config, as snakemake-executor-plugin-slurm renders
it under `--profile slurm`: Qwen2.5-72B on 4 nodes of 8xH100 and Llama-3.1-8B on one RTX 4090.

The workflow's DAG is built in-process (the real Snakefile, rules and resource functions, the
profile's default-resources and set-resources); each job's resources then go through the plugin's
own `get_submit_command` + `set_gres_string` + `get_partition_arg`/`get_account_arg`, the calls
`Executor.run_job` composes before it runs sbatch. Only the site check of the account
(`sacctmgr`/`sshare`) is replaced: there is no cluster here.

Two DAG states cover every job: a fresh tree (prepare_data, estimate_candidates), then one where
estimate_candidates and select_config ran for real (memfit.workflow.pipeline, the prediction deciding: no
probe has run) and the data stage is marked done, so the probes, train and verify_resume jobs exist
with the estimate's host RAM in their memory.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from memfit.workflow import pipeline
from memfit.workflow.config import WorkflowConfig
from memfit.workflow.slurm import mem_mb

ROOT = Path(__file__).resolve().parents[1]
PROFILE = yaml.safe_load((ROOT / "slurm" / "config.yaml").read_text())

plugin = pytest.importorskip("snakemake_executor_plugin_slurm")
from snakemake_executor_plugin_slurm.submit_string import get_submit_command  # noqa: E402
from snakemake_executor_plugin_slurm.utils import set_gres_string  # noqa: E402

SLURM = {
    "partition": "gpu",
    "cpu_partition": "cpu",
    "account": "proj1",
    "cpus_per_gpu": 12,
    "runtime_min": {"train": 2880},
    "gpu_types": {
        "h100-80gb": {"gpu_model": "h100", "constraint": "sxm"},
        "rtx4090": {"gpu_model": "rtx4090"},
    },
}

# (model, gpu, num_gpus, num_nodes, search overrides): the two targets of the issue
TARGETS = {
    "qwen72b-4x8xh100": ("qwen2.5-72b", "h100-80gb", 8, 4, {}),
    "llama8b-1xrtx4090": (
        "llama-3.1-8b",
        "rtx4090",
        1,
        1,
        # the chunked loss: with full fp32 logits (and the allocator's cached block) an 8B LoRA
        # at 2048 tokens is predicted 0.3 GiB over a 4090's budget
        {
            "finetune": ["lora"],
            "zero": [0],
            "offload_param": ["none"],
            "micro_batch": [1, 2],
            "loss_impl": ["chunked"],
        },
    ),
}


def _config(tmp: Path, model: str, gpu: str, num_gpus: int, num_nodes: int, search: dict) -> dict:
    cfg = yaml.safe_load((ROOT / "config" / "cluster-example.yaml").read_text())
    # an empty model directory stands for weights on a shared filesystem (config validation
    # takes the architecture from the catalog then); nothing here loads weights
    (tmp / "models" / model).mkdir(parents=True)
    cfg["models"] = {model: {"path": str(tmp / "models" / model)}}
    cfg.update(gpus=[gpu], num_gpus=num_gpus, num_nodes=num_nodes, methods=["sft"])
    cfg.pop("run", None)  # the default layout, results/<model>/..., which the paths below name
    cfg["estimate"] = {"activations": "analytic"}
    cfg["search"].update(search)
    cfg["slurm"] = SLURM
    (tmp / "config.yaml").write_text(yaml.safe_dump(cfg))
    return cfg


def _jobs(tmp: Path):
    """The jobs Snakemake would run in `tmp`, with their evaluated resources (the profile applied)."""
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import (
        ConfigSettings,
        DAGSettings,
        OutputSettings,
        ResourceSettings,
        StorageSettings,
    )

    cwd = os.getcwd()
    try:
        with SnakemakeApi(OutputSettings()) as api:
            wapi = api.workflow(
                resource_settings=ResourceSettings(
                    cores=256,
                    default_resources=PROFILE["default-resources"],
                    overwrite_resources=PROFILE.get("set-resources", {}),
                ),
                config_settings=ConfigSettings(configfiles=[tmp / "config.yaml"]),
                storage_settings=StorageSettings(),
                snakefile=ROOT / "Snakefile",
                workdir=tmp,
            )
            wapi.dag(DAGSettings())
            wf = wapi._workflow
            wf._prepare_dag(forceall=False, ignore_incomplete=True, lock_warn_only=True, nolock=True)
            wf._build_dag()
            # what Workflow.is_local answers when an executor plugin runs the jobs remotely
            local = wf._localrules
            jobs = list(wf.dag.needrun_jobs())
            for job in jobs:  # evaluated lazily: read the files while in the workdir
                job.resources  # noqa: B018
            return [(job, job.rule.name in local or job.rule.norun) for job in jobs]
    finally:
        os.chdir(cwd)


def _sbatch(job, tmp: Path, monkeypatch) -> str:
    """The sbatch call the plugin's Executor.run_job would make for `job` (before --wrap)."""
    monkeypatch.setattr(plugin, "validate_account", lambda account, _logger: account)
    fake_executor = SimpleNamespace(_partitions=None, _fallback_partition=None, _fallback_account_arg=None, logger=None)
    params = {
        "run_uuid": "run-uuid",
        "slurm_logfile": tmp / ".snakemake/slurm_logs/%j.log",
        "comment_str": f"rule_{job.name}",
        "account": next(plugin.Executor.get_account_arg(fake_executor, job)),
        "partition": plugin.Executor.get_partition_arg(fake_executor, job),
        "workdir": str(tmp),
    }
    call = get_submit_command(job, params, settings=plugin.ExecutorSettings(status_command="squeue"))
    call += set_gres_string(job)
    print(call)  # shown with pytest -s
    return call


def _flags(call: str) -> dict[str, str]:
    """sbatch's options as {flag: value} (`--x=v`, `--x v`, `-x v`; bare flags map to "")."""
    words = shlex.split(call)[1:]
    out, i = {}, 0
    while i < len(words):
        w = words[i]
        if "=" in w and w.startswith("--"):
            k, v = w.split("=", 1)
            out[k] = v
        elif i + 1 < len(words) and not words[i + 1].startswith("-"):
            out[w], i = words[i + 1], i + 1
        else:
            out[w] = ""
        i += 1
    return out


def _mark_data_done(tmp: Path, model: str, t: float) -> Path:
    """prepare_data's outputs as present (older than the estimate): its job was rendered in the
    fresh tree; this tree is about the jobs after the estimate."""
    data = tmp / "results" / model / "data" / "sft"
    data.mkdir(parents=True)
    for name in ("train.parquet", "eval.parquet", "stats.json"):
        # select_config counts the training steps from stats.json's rows (memfit.train.dsconfig)
        (data / name).write_text(
            json.dumps({"rows_kept": {"train": 10000, "eval": 200}}) if name == "stats.json" else ""
        )
        os.utime(data / name, (t - 300, t - 300))
    return data


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_job_of_a_gpu_config_renders_the_sbatch_it_needs(target, tmp_path, monkeypatch):
    model, gpu, num_gpus, num_nodes, search = TARGETS[target]
    (tmp_path / "data").symlink_to(ROOT / "data")
    raw = _config(tmp_path, model, gpu, num_gpus, num_nodes, search)

    # -- a fresh tree: the jobs before the estimate --------------------------------------
    fresh = {job.name: (job, local) for job, local in _jobs(tmp_path)}
    assert {"prepare_data", "estimate_candidates", "train", "verify_resume"} <= set(fresh)
    for name in ("select_config", "report", "candidates_table", "all"):  # short: run where snakemake runs
        assert fresh[name][1], f"{name} should be a local rule"
    for name, runtime in (("prepare_data", 60), ("estimate_candidates", 30)):
        job, local = fresh[name]
        assert not local
        f = _flags(_sbatch(job, tmp_path, monkeypatch))
        assert f["-p"] == "cpu" and f["-A"] == "proj1" and f["-t"] == str(runtime), f
        assert f["--mem"] == str(PROFILE["default-resources"]["mem_mb"])
        assert f["--ntasks"] == "1" and "--gpus" not in f and "--gres" not in f
    # before select has run, train's memory cannot be known: Snakemake defers it (<TBD>)
    assert str(fresh["train"][0].resources.get("mem_mb")) == "<TBD>"

    # -- estimate and select ran (for real); the data stage is done -----------------------
    cfg = WorkflowConfig.load(raw)
    t = 1.9e9
    data = _mark_data_done(tmp_path, model, t)
    run_dir = tmp_path / "results" / model / gpu / "sft"
    # the empty directory stands for weights on the cluster's filesystem: skip the up-front model
    # check (memfit.workflow.model_check, tested in tests/test_model_check.py) that a real run does here
    monkeypatch.setattr(pipeline, "check_model", lambda *_: None)
    table = pipeline.estimate_candidates(cfg, model, gpu, "sft", run_dir / "candidates.json")
    out = {k: run_dir / f"{k}.json" for k in ("selected", "ds_config", "run")}
    out["launch"] = run_dir / "launch.sh"
    selected = pipeline.select_config(
        cfg,
        model,
        gpu,
        "sft",
        run_dir / "candidates.json",
        [],
        str(tmp_path / "models" / model),
        str(data),
        str(run_dir / "train"),
        out,
    )
    for p in out.values():  # select ran before this estimate: it runs again, after the probes
        os.utime(p, (t - 200, t - 200))
    os.utime(run_dir / "candidates.json", (t - 100, t - 100))

    jobs = {}
    for job, local in _jobs(tmp_path):
        jobs.setdefault(job.name, []).append((job, local))
    probes = jobs.pop("probe_candidate")
    assert sorted(j.wildcards_dict["cand"] for j, _ in probes) == sorted(table["probe"])
    rows = {r["id"]: r for r in table["rows"]}
    rendered = [(j, rows[j.wildcards_dict["cand"]]["host_bytes"], 30) for j, _ in probes]
    rendered += [(jobs["train"][0][0], selected["selected"]["host_bytes"], 2880)]
    rendered += [(jobs["verify_resume"][0][0], selected["selected"]["host_bytes"], 240)]
    assert jobs["select_config"][0][1] and jobs["report"][0][1]

    for job, host_bytes, runtime in rendered:
        call = _sbatch(job, tmp_path, monkeypatch)
        f = _flags(call)
        where = f"{job.name} {job.wildcards_dict}: {call}"
        if job.name == "probe_candidate":  # probe.timeout_s 1200 -> 20 min + 10 to start
            runtime = 30
        assert f["--nodes"] == str(num_nodes), where
        assert f["-p"] == "gpu" and f["-A"] == "proj1", where
        assert f["-t"] == str(runtime), where
        # memory per node: the estimate's host RAM (pinned offload buffers included) + margin
        assert f["--mem"] == str(mem_mb(host_bytes)), where
        assert int(f["--mem"]) * 2**20 > host_bytes, where
        assert f["--cpus-per-gpu"] == "12", where
        assert "--ntasks" not in f and "--ntasks-per-gpu" not in f, where
        if num_nodes == 1:  # --gpus counts the job's GPUs: one node holds them all
            assert f["--gpus"] == f"{SLURM['gpu_types'][gpu]['gpu_model']}:{num_gpus}", where
            assert "--gres" not in f, where
        else:  # --gres counts per node: 8 on each of the 4 nodes, never 32 spread unevenly
            assert f["--gres"] == f"gpu:h100:{num_gpus}" and "--gpus" not in f, where
        if gpu == "h100-80gb":
            assert f["-C"] == "sxm", where
        else:
            assert "-C" not in f, where
        if job.name in ("train", "verify_resume"):  # the profile's advance warning
            assert re.search(r"--signal=USR1@300\b", call), where
        else:
            assert "--signal" not in call, where

    # the 72B run needs more host RAM than an 8B LoRA run: memory follows the estimate
    assert json.loads((run_dir / "selected.json").read_text())["selected"]["host_bytes"] > 0
