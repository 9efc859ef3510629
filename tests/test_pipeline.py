"""The workflow's plan stages without Snakemake: estimate_candidates then select_config (plan only)."""

from __future__ import annotations

import json

import pytest
import yaml

from memfit import pipeline
from memfit.config import WorkflowConfig
from memfit.train import RunConfig


@pytest.fixture()
def cfg(repo, monkeypatch) -> WorkflowConfig:
    monkeypatch.chdir(repo)
    raw = yaml.safe_load((repo / "config/cluster-example.yaml").read_text())
    raw.update(plan_only=True, estimate={"activations": "analytic"})  # no weights here; no tracing
    return WorkflowConfig.load(raw)


def test_plan_for_hardware_not_present(cfg, tmp_path):
    run = tmp_path / "qwen2.5-7b/a100-80gb/sft"
    table = pipeline.estimate_candidates(cfg, "qwen2.5-7b", "a100-80gb", "sft", run / "candidates.json")
    written = json.loads((run / "candidates.json").read_text())
    assert [r["id"] for r in written["rows"]] == [r["id"] for r in table["rows"]]
    assert table["probe"] == []  # plan only: nothing to probe on
    assert table["world_size"] == cfg.world_size == 8
    assert len(table["rows"]) == len(cfg.candidates("sft"))
    assert table["budget"]["device_bytes"] == cfg.budget("a100-80gb").device_bytes

    out = {"selected": run / "selected.json", "ds_config": run / "ds_config.json", "run": run / "run.json",
           "launch": run / "launch.sh"}
    # a stage may get the dict Snakemake holds instead of the WorkflowConfig: the same result
    selected = pipeline.select_config(dict(cfg.raw), "qwen2.5-7b", "a100-80gb", "sft", run / "candidates.json", [],
                                      "/models/qwen", "data", str(run / "train"), out)
    best = selected["selected"]
    assert selected["plan_only"] and best["fits"] and best["source"] == "predicted"
    assert best["device_bytes"] <= cfg.budget("a100-80gb").device_limit_bytes
    assert all(best["tokens_per_s"] >= r["tokens_per_s"] for r in selected["candidates"] if r["fits"])
    rc = RunConfig.load(run / "run.json")
    assert (rc.candidate, rc.model_path, rc.out_dir) == (best["candidate"], "/models/qwen", str(run / "train"))
    ds = json.loads((run / "ds_config.json").read_text())
    c = best["candidate"]
    assert ds["train_micro_batch_size_per_gpu"] == c["micro_batch"]
    assert ds["train_batch_size"] == c["micro_batch"] * c["grad_accum"] * 8 == cfg.raw["train"]["global_batch"]
    assert f"--nproc {cfg.num_gpus}" in (run / "launch.sh").read_text()
