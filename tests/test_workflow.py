"""The DAG as Snakemake sees it: parameterised by model, GPU and method; bad configs stop early.

Every dry run happens in a fresh checkout (links to the workflow, config, data and code in a
temporary directory, no results yet), so it plans every job and the counts below are exact:
a run that planned nothing would fail them.
"""

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

SNAKEMAKE = [sys.executable, "-m", "snakemake", "--nolock", "--cores", "2"]
CHECKOUT = ("Snakefile", "workflow", "config", "data", "src", "envs")


@pytest.fixture()
def checkout(repo, tmp_path) -> Path:
    root = tmp_path / "checkout"
    root.mkdir()
    for name in CHECKOUT:
        (root / name).symlink_to(repo / name)
    return root


def dry_run(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SNAKEMAKE, "-n", *args], cwd=root, capture_output=True, text=True, timeout=300)


def job_inputs(out: str, rule: str) -> dict[str, list[str]]:
    """`wildcards` line -> input files, for each planned job of `rule`."""
    jobs = {}
    for block in re.split(r"\n(?=(?:rule|checkpoint|localrule) )", out):
        if not block.startswith((f"rule {rule}:", f"checkpoint {rule}:", f"localrule {rule}:")):
            continue
        inputs = re.search(r"^\s+input: (.*)$", block, re.M)
        wildcards = re.search(r"^\s+wildcards: (.*)$", block, re.M)
        jobs[wildcards.group(1) if wildcards else ""] = inputs.group(1).split(", ") if inputs else []
    return jobs


def job_counts(out: str) -> Counter:
    counts = Counter()
    table = out.split("Job stats:")[-1]
    for line in table.splitlines():
        m = re.match(r"^(\w+)\s+(\d+)$", line.strip())
        if m and m.group(1) != "total":
            counts[m.group(1)] = int(m.group(2))
    return counts


def test_embedded_default_dag(checkout):
    res = dry_run(checkout)
    assert res.returncode == 0, res.stderr + res.stdout
    counts = job_counts(res.stdout)
    # one model, one "gpu" (cpu), sft and dpo; the probes are known once estimate_candidates ran
    assert counts == {
        "build_demo_model": 1,
        "prepare_data": 2,
        "calibrate": 1,
        "estimate_candidates": 2,
        "select_config": 2,
        "train": 2,
        "verify_resume": 2,
        "candidates_table": 1,
        "report": 1,
        "all": 1,
    }, counts
    train = job_inputs(res.stdout, "train")
    # SFT starts from the built model; DPO from the SFT output (its summary is written after the export)
    assert "resources/demo-tiny" in train["model=demo-tiny, gpu=cpu, method=sft"]
    dpo = train["model=demo-tiny, gpu=cpu, method=dpo"]
    assert "results/demo-tiny/cpu/sft/train/summary.json" in dpo and "resources/demo-tiny" not in dpo


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


def test_dag_is_parameterised_by_model_gpu_and_method(repo, checkout, tmp_path):
    path = cluster_config(repo, tmp_path)
    res = dry_run(checkout, "--configfile", str(path))
    assert res.returncode == 0, res.stderr + res.stdout
    counts = job_counts(res.stdout)
    # 3 models x 2 GPU types x 2 methods; data prepared once per model and method.
    assert counts["estimate_candidates"] == 12
    assert counts["train"] == 12 and counts["verify_resume"] == 12 and counts["select_config"] == 12
    assert counts["prepare_data"] == 6
    assert counts["calibrate"] == 6  # one per model and GPU type, shared by both methods
    assert "build_demo_model" not in counts
    for gpu in ("a100-80gb", "h100-80gb"):  # run: cluster-example
        assert f"results/cluster-example/qwen2.5-72b/{gpu}/dpo/train/summary.json" in res.stdout


def test_plan_only_stops_after_selection(repo, checkout, tmp_path):
    path = cluster_config(repo, tmp_path, plan_only=True)
    res = dry_run(checkout, "--configfile", str(path))
    assert res.returncode == 0, res.stderr + res.stdout
    counts = job_counts(res.stdout)
    assert counts == {"estimate_candidates": 12, "select_config": 12, "candidates_table": 1, "report": 1, "all": 1}, (
        counts
    )


def test_bad_config_stops_before_any_job(repo, checkout, tmp_path):
    cfg = yaml.safe_load((repo / "config/config.yaml").read_text())
    cfg["gpus"] = ["a100-81gb"]
    cfg["search"]["zero"] = [5]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    res = dry_run(checkout, "--configfile", str(path))
    assert res.returncode != 0
    err = res.stderr + res.stdout
    assert "search.zero.0: 5 is not allowed (allowed: 0, 1, 2, 3)" in err
    assert "Job stats" not in err


def planned_paths(out: str) -> dict[str, set[str]]:
    """Every output, log and benchmark path a dry run plans, by kind."""
    found: dict[str, set[str]] = {"output": set(), "log": set(), "benchmark": set()}
    for kind, paths in re.findall(r"^\s+(output|log|benchmark): (.*)$", out, re.M):
        found[kind] |= set(paths.split(", "))
    return found


def test_several_configurations_live_side_by_side_in_one_clone(checkout):
    """config/qlora.yaml (run: qlora) plans every output under results/qlora/, its logs under
    logs/qlora/ and its benchmarks under benchmarks/qlora/: the default's results/, logs/ and
    report stay as they are, in the same clone. Only the built model is shared."""
    default = dry_run(checkout)
    qlora = dry_run(checkout, "--configfile", "config/qlora.yaml")
    assert default.returncode == 0 and qlora.returncode == 0, qlora.stderr + qlora.stdout
    mine, theirs = planned_paths(qlora.stdout), planned_paths(default.stdout)
    assert "results/qlora/report.html" in mine["output"] and "results/report.html" in theirs["output"]
    assert "results/qlora/demo-tiny/cpu/dpo/train/summary.json" in mine["output"]
    for kind, top in (("output", "results/qlora/"), ("log", "logs/qlora/"), ("benchmark", "benchmarks/qlora/")):
        stray = {p for p in mine[kind] if not p.startswith(top) and p != "resources/demo-tiny"}
        assert mine[kind] and not stray, (kind, stray)
    assert not (mine["output"] - {"resources/demo-tiny"}) & theirs["output"]
    assert not mine["log"] & theirs["log"] and not mine["benchmark"] & theirs["benchmark"]
    # DPO starts from this run's SFT output, not the default's
    dpo = job_inputs(qlora.stdout, "train")["model=demo-tiny, gpu=cpu, method=dpo"]
    assert "results/qlora/demo-tiny/cpu/sft/train/summary.json" in dpo
