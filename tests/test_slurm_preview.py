"""The plan-only SLURM preview (`snakemake -n --profile slurm` with `plan_only: true`), as a user runs it
on a machine with neither the model weights nor conda: it lists the estimate and selection jobs; a
real run without conda stops before any job, naming the profile key and the way out.

Each test runs snakemake as the user does, from the repo root, with a PATH that holds no `conda`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from memfit.workflow import slurm

ROOT = Path(__file__).resolve().parents[1]
SNAKEMAKE = [sys.executable, "-m", "snakemake", "--nolock", "--profile", "slurm"]


def _no_conda_env() -> dict[str, str]:
    """This environment with every PATH entry that holds a `conda` removed."""
    env = dict(os.environ)
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and not (Path(p) / "conda").exists()]
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), *path])
    return env


def _run(args: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*SNAKEMAKE, *args], cwd=ROOT, env=_no_conda_env(), capture_output=True, text=True, timeout=timeout
    )


def _plan_only_config(tmp_path: Path) -> Path:
    """The cluster example with plan_only: true, a catalog model whose weights are not here and a
    model known by its config.json only (no path at all)."""
    cfg = yaml.safe_load((ROOT / "config" / "cluster-example.yaml").read_text())
    cfg["run"] = f"test-preview-{os.getpid()}"
    cfg["plan_only"] = True
    cfg["models"] = {
        "qwen2.5-72b": {"path": str(tmp_path / "no-such-weights")},
        "demo-gpu": {"path": None, "arch": str(ROOT / "config" / "models" / "demo-gpu.json")},
    }
    path = tmp_path / "preview.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _job_counts(stdout: str) -> dict[str, int]:
    """The dry run's "Job stats" table: rule -> number of jobs."""
    lines = stdout.split("Job stats:", 1)[1].splitlines()
    counts = {}
    for line in lines[3:]:
        parts = line.split()
        if len(parts) != 2 or parts[0] == "total":
            break
        counts[parts[0]] = int(parts[1])
    return counts


def test_plan_only_preview_needs_no_weights_and_no_conda(tmp_path):
    cfg = _plan_only_config(tmp_path)
    res = _run(["-n", "--configfile", str(cfg)])
    assert res.returncode == 0, res.stderr + res.stdout
    # 2 models x 2 GPUs x 2 methods: estimate and select each, no data, probe or training job
    assert _job_counts(res.stdout) == {
        "estimate_candidates": 8,
        "select_config": 8,
        "candidates_table": 1,
        "report": 1,
        "all": 1,
    }
    assert "no-such-weights" not in res.stdout  # no job reads the weights directory
    # the note says what the preview left out and how a real run goes without conda
    assert "conda is not on PATH; this dry run lists the jobs without their conda env" in res.stderr
    assert "--workflow-profile slurm/no-conda" in res.stderr


def test_the_no_conda_workflow_profile_turns_conda_off(tmp_path):
    cfg = _plan_only_config(tmp_path)
    res = _run(["-n", "--workflow-profile", "slurm/no-conda", "--configfile", str(cfg)])
    assert res.returncode == 0, res.stderr + res.stdout
    assert "slurm/no-conda" in res.stdout + res.stderr  # snakemake names the profiles it uses
    assert "conda is not on PATH" not in res.stderr  # nothing deploys conda envs: no note


def test_cluster_example_preview_as_docs_show_it():
    """docs/slurm.md's preview command, on the shipped example whose /models/... are not here."""
    args = ["-n", "--configfile", "config/cluster-example.yaml"]
    assert not Path("/models/Qwen2.5-72B-Instruct").exists()
    res = _run([*args, "--config", "plan_only=True"])
    assert res.returncode == 0, res.stderr + res.stdout
    assert _job_counts(res.stdout)["select_config"] == 12
    # without plan_only the same preview is a training run, and training needs the weights
    res = _run(args)
    assert res.returncode != 0
    assert (
        "models.qwen2.5-72b.path: '/models/Qwen2.5-72B-Instruct' is not a model directory; "
        "training needs weights (or set plan_only: true)"
    ) in res.stderr + res.stdout


def test_a_real_run_without_conda_stops_before_any_job_naming_the_way_out(tmp_path):
    cfg = _plan_only_config(tmp_path)
    run = yaml.safe_load(cfg.read_text())["run"]
    res = _run(["--configfile", str(cfg)])
    assert res.returncode != 0
    out = res.stderr + res.stdout
    assert "conda is not on PATH, and this run deploys every rule in the conda env envs/memfit-gpu.yaml" in out
    assert "(use-conda: true in the slurm profile" in out
    assert "--workflow-profile slurm/no-conda" in out
    assert "Building DAG" not in out and "sbatch" not in out  # stopped while reading the workflow
    assert not (ROOT / "results" / run).exists() and not (ROOT / "logs" / run).exists()


@pytest.mark.parametrize(
    ("uses_conda", "dryrun", "found", "expected"),
    [
        (False, False, False, "envs/x.yaml"),  # conda off: the directive is ignored anyway
        (True, False, True, "envs/x.yaml"),
        (True, True, True, "envs/x.yaml"),  # a dry run with conda keeps the env (unchanged)
        (True, True, False, None),
    ],
)
def test_conda_env_of_a_rule(uses_conda, dryrun, found, expected):
    got = slurm.conda_env("../../envs/x.yaml", uses_conda=uses_conda, dryrun=dryrun, conda_found=found)
    assert got == (None if expected is None else "../../envs/x.yaml")


def test_conda_env_of_a_real_run_without_conda_names_both_ways_out():
    with pytest.raises(
        slurm.NoCondaError, match=r"envs/x\.yaml .*--workflow-profile slurm/no-conda.*leave out --use-conda"
    ):
        slurm.conda_env("../../envs/x.yaml", uses_conda=True, dryrun=False, conda_found=False)
