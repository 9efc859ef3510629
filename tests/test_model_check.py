"""Up-front model checks: a model directory that cannot load stops the workflow before any probe,
with an error naming the file (memfit.workflow.model_check, called by prepare_data and estimate_candidates).

Every case is the real demo model (tests/conftest.py builds it) with one thing broken the way
downloads break: a shard missing, the tokenizer missing, a truncated file, an architecture memfit
cannot estimate.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from memfit.workflow import pipeline
from memfit.workflow.config import WorkflowConfig
from memfit.workflow.model_check import ModelCheckError, check_model_dir


@pytest.fixture(scope="module")
def sharded_model(demo_model, tmp_path_factory) -> Path:
    """The demo model saved in 4 safetensors shards with an index (how large models ship)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("sharded") / "demo-sharded"
    shutil.copytree(demo_model, out, ignore=shutil.ignore_patterns("model.safetensors"))
    AutoModelForCausalLM.from_pretrained(demo_model).save_pretrained(out, max_shard_size="4MB")
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    return out


def broken(model: Path, tmp_path: Path, how) -> Path:
    d = tmp_path / "model"
    shutil.copytree(model, d)
    how(d)
    return d


def edit_config(d: Path, **fields) -> None:
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | fields))


def test_a_complete_model_directory_passes(demo_model, sharded_model):
    found = check_model_dir(demo_model)
    assert found.arch.model_type == "llama"
    assert found.weight_files == [demo_model / "model.safetensors"]
    assert demo_model / "tokenizer.json" in found.tokenizer_files
    shards = check_model_dir(sharded_model).weight_files
    assert shards == sorted(sharded_model.glob("model-*-of-*.safetensors"))


def test_a_missing_shard_names_the_shard(sharded_model, tmp_path):
    shard = sorted(sharded_model.glob("model-*-of-*.safetensors"))[1].name
    d = broken(sharded_model, tmp_path, lambda d: (d / shard).unlink())
    with pytest.raises(
        ModelCheckError,
        match=rf"^{d / shard}: missing \(model.safetensors.index.json maps \d+ tensors",
    ):
        check_model_dir(d)


def test_a_shard_that_does_not_match_its_index(sharded_model, tmp_path):
    a, b = sorted(sharded_model.glob("model-*-of-*.safetensors"))[:2]

    def swap(d: Path) -> None:  # shard 1 overwritten by shard 2's tensors: present, readable, wrong
        shutil.copy(d / b.name, d / a.name)

    d = broken(sharded_model, tmp_path, swap)
    with pytest.raises(ModelCheckError, match=rf"^{d / a.name}: has no tensor '.+' .* does not match the index"):
        check_model_dir(d)


def test_no_weights_at_all(demo_model, tmp_path):
    d = broken(demo_model, tmp_path, lambda d: (d / "model.safetensors").unlink())
    with pytest.raises(ModelCheckError, match=rf"^{d / 'model.safetensors'}: missing: no weights in {d}"):
        check_model_dir(d)


@pytest.mark.parametrize("keep", [1000, 4])  # cut in the tensor data; cut inside the header length
def test_a_truncated_safetensors_file(demo_model, tmp_path, keep):
    def cut(d: Path) -> None:
        p = d / "model.safetensors"
        os.truncate(p, keep if keep < 100 else p.stat().st_size - keep)

    d = broken(demo_model, tmp_path, cut)
    with pytest.raises(
        ModelCheckError,
        match=rf"^{d / 'model.safetensors'}: unreadable safetensors file .*truncated",
    ):
        check_model_dir(d)


def test_a_missing_tokenizer(demo_model, tmp_path):
    d = broken(demo_model, tmp_path, lambda d: (d / "tokenizer.json").unlink())
    with pytest.raises(ModelCheckError, match=rf"^{d / 'tokenizer.json'}: missing: no tokenizer files in {d}"):
        check_model_dir(d)


def test_a_corrupt_tokenizer(demo_model, tmp_path):
    d = broken(
        demo_model,
        tmp_path,
        lambda d: (d / "tokenizer.json").write_text('{"version": "1.0", "model": '),
    )
    with pytest.raises(ModelCheckError, match=rf"^{d / 'tokenizer.json'}: not readable JSON"):
        check_model_dir(d)


def test_an_unsupported_architecture(demo_model, tmp_path):
    """A type transformers does not build as a causal LM is refused naming it (every type it
    does build is estimated from transformers' own model: docs/architectures.md)."""
    d = broken(demo_model, tmp_path, lambda d: edit_config(d, model_type="weirdnet"))
    with pytest.raises(
        ModelCheckError,
        match=rf"^{d / 'config.json'}: model_type 'weirdnet' is not in transformers' AutoModelForCausalLM",
    ):
        check_model_dir(d)


def test_config_json_missing_or_not_json(demo_model, tmp_path):
    d = broken(demo_model, tmp_path, lambda d: (d / "config.json").unlink())
    with pytest.raises(ModelCheckError, match=rf"^{d / 'config.json'}: missing"):
        check_model_dir(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelCheckError, match=rf"^{d / 'config.json'}: not valid JSON"):
        check_model_dir(d)


# ------------------------------------------------------------------ the stages, before any probe
def demo_config(repo: Path, model_dir: Path, **overrides) -> WorkflowConfig:
    raw = yaml.safe_load((repo / "config/config.yaml").read_text())
    raw["models"] = {"demo-tiny": {"path": str(model_dir)}}
    raw["data"] = {
        **raw["data"],
        "sft": str(repo / "data/demo/sft.jsonl"),
        "dpo": str(repo / "data/demo/dpo.jsonl"),
    }
    raw["estimate"] = {"activations": "analytic"}
    raw.update(overrides)
    return WorkflowConfig.load(raw)


def test_the_stages_before_the_probes_refuse_a_broken_model(repo, demo_model, tmp_path, monkeypatch):
    """prepare_data and estimate_candidates stop on a truncated weight file (which the config's
    own validation, a presence check, lets through); neither leaves an output."""

    def cut(d: Path) -> None:
        os.truncate(d / "model.safetensors", (d / "model.safetensors").stat().st_size // 2)

    d = broken(demo_model, tmp_path, cut)
    monkeypatch.chdir(tmp_path)
    cfg = demo_config(repo, d)
    data = tmp_path / "data/sft"
    with pytest.raises(ModelCheckError, match=rf"^{d / 'model.safetensors'}: unreadable"):
        pipeline.prepare_data("sft", str(repo / "data/demo/sft.jsonl"), str(d), data, max_len=24)
    assert not data.parent.exists() or not any(data.parent.iterdir())
    out = tmp_path / "run/candidates.json"
    with pytest.raises(ModelCheckError, match=rf"^{d / 'model.safetensors'}: unreadable"):
        pipeline.estimate_candidates(cfg, "demo-tiny", "cpu", "sft", out)
    assert not out.parent.exists() or not any(out.parent.iterdir())
    # a plan-only run never loads the weights: it plans from config.json alone
    table = pipeline.estimate_candidates(demo_config(repo, d, plan_only=True), "demo-tiny", "cpu", "sft", out)
    assert table["probe"] == [] and out.exists()


def test_snakemake_stops_at_prepare_data_naming_the_file(repo, demo_model, tmp_path):
    """A real Snakemake run of the workflow on a model directory without its tokenizer: the first
    job fails, the console names the file, no output of it or any later job exists."""
    d = broken(demo_model, tmp_path, lambda d: (d / "tokenizer.json").unlink())
    root = tmp_path / "checkout"
    root.mkdir()
    for name in ("Snakefile", "workflow", "config", "data", "src", "envs"):
        (root / name).symlink_to(repo / name)
    raw = yaml.safe_load((repo / "config/config.yaml").read_text())
    raw["models"] = {"demo-tiny": {"path": str(d)}}
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump(raw))
    env = {**os.environ, "PYTHONPATH": str(repo / "src")}
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "results/demo-tiny/cpu/sft/selected.json",
            "--nolock",
            "--cores",
            "1",
            "--configfile",
            str(tmp_path / "broken.yaml"),
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    console = res.stdout + res.stderr
    assert res.returncode != 0, console
    assert f"memfit: ModelCheckError: {d / 'tokenizer.json'}: missing" in console, console
    assert "Error in rule prepare_data" in console
    assert not (root / "results").exists() or not list((root / "results").rglob("*.json")), list(
        (root / "results").rglob("*")
    )
