"""The DAG as Snakemake sees it: parameterised by model, GPU and method; bad configs stop early."""

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import yaml

SNAKEMAKE = [sys.executable, "-m", "snakemake", "--nolock", "--cores", "2"]


def dry_run(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SNAKEMAKE, "-n", *args], cwd=repo, capture_output=True, text=True, timeout=300)


def job_counts(out: str) -> Counter:
    counts = Counter()
    table = out.split("Job stats:")[-1]
    for line in table.splitlines():
        m = re.match(r"^(\w+)\s+(\d+)$", line.strip())
        if m and m.group(1) != "total":
            counts[m.group(1)] = int(m.group(2))
    return counts


def test_embedded_default_dag(repo):
    res = dry_run(repo)
    assert res.returncode == 0, res.stderr + res.stdout
    counts = job_counts(res.stdout)
    for rule in ("prepare_data", "estimate_candidates", "select_config", "train", "verify_resume"):
        assert counts[rule] in (0, 2), (rule, counts)  # sft and dpo (0 once they have run)
    assert counts["report"] <= 1


def cluster_config(repo: Path, tmp_path: Path, **overrides) -> Path:
    cfg = yaml.safe_load((repo / "config/cluster-example.yaml").read_text())
    for name, model in cfg["models"].items():
        d = tmp_path / name  # stands in for a local weights directory (dry run reads nothing)
        d.mkdir()
        model["path"] = str(d)
    cfg.update(overrides)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_dag_is_parameterised_by_model_gpu_and_method(repo, tmp_path):
    path = cluster_config(repo, tmp_path)
    res = dry_run(repo, "--configfile", str(path))
    assert res.returncode == 0, res.stderr + res.stdout
    counts = job_counts(res.stdout)
    # 3 models x 2 GPU types x 2 methods; data prepared once per model and method.
    assert counts["estimate_candidates"] == 12
    assert counts["train"] == 12 and counts["verify_resume"] == 12 and counts["select_config"] == 12
    assert counts["prepare_data"] == 6
    assert "build_demo_model" not in counts
    for gpu in ("a100-80gb", "h100-80gb"):
        assert f"results/qwen2.5-72b/{gpu}/dpo/train/summary.json" in res.stdout


def test_plan_only_stops_after_selection(repo, tmp_path):
    path = cluster_config(repo, tmp_path, plan_only=True)
    res = dry_run(repo, "--configfile", str(path))
    assert res.returncode == 0, res.stderr + res.stdout
    counts = job_counts(res.stdout)
    assert counts["estimate_candidates"] == 12 and counts["report"] == 1
    assert not {"prepare_data", "probe_candidate", "train", "verify_resume"} & set(counts)


def test_bad_config_stops_before_any_job(repo, tmp_path):
    cfg = yaml.safe_load((repo / "config/config.yaml").read_text())
    cfg["gpus"] = ["a100-81gb"]
    cfg["search"]["zero"] = [5]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    res = dry_run(repo, "--configfile", str(path))
    assert res.returncode != 0
    err = res.stderr + res.stdout
    assert "search.zero.0: 5 is not allowed (allowed: 0, 1, 2, 3)" in err
    assert "Job stats" not in err
