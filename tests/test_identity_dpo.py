"""SFT trained again (new weights, same path), then DPO re-run: it trains every step again from the
new SFT model, with reference log-probs computed from it, instead of resuming its old final
checkpoint (issue #41). memfit.workflow.pipeline.train on 2 CPU ranks (gloo), as the train rule
runs it; Snakemake re-runs that rule because the SFT summary.json is its input
(tests/test_workflow.py asserts the edge)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
from deepspeed_runs import base_run
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from memfit.train import identity
from memfit.workflow import pipeline

pytestmark = pytest.mark.slow


def ref_logps(train_dir):
    with safe_open(str(train_dir / "ref_logps.safetensors"), framework="pt") as f:
        return f.metadata(), f.get_tensor("train")


def train_steps(train_dir):
    rows = [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if r["split"] == "train"]


def test_dpo_after_sft_retrained_trains_again_from_the_new_model(demo_model, repo, tmp_path, monkeypatch):
    from memfit.data import prepare

    monkeypatch.setenv(identity.CACHE_ENV, str(tmp_path / "sha256.json"))
    # 96 demo pairs: the reference pass over all 1,600 took most of the test's time
    (tmp_path / "pairs.jsonl").write_text("".join((repo / "data/demo/dpo.jsonl").read_text().splitlines(True)[:96]))
    prepare("dpo", tmp_path / "pairs.jsonl", demo_model, tmp_path / "data/dpo", max_len=32, eval_fraction=0.1)
    sft_model = tmp_path / "sft/train/model"  # the SFT run's export, what DPO starts from
    shutil.copytree(demo_model, sft_model)
    job, train_dir = tmp_path / "dpo", tmp_path / "dpo/train"
    cfg = base_run(demo_model, tmp_path / "data", train_dir, method="dpo", ref="precomputed", zero=0)
    cfg = dataclasses.replace(
        cfg, model_path=str(sft_model), ref_model_path=str(sft_model), max_steps=2, save_every=2, eval_every=2
    )
    job.mkdir()
    cfg.save(job / "run.json")
    run_json = (job / "run.json").read_text()
    log = job / "train.log"

    pipeline.train(job / "run.json", 2, log)
    assert train_steps(train_dir) == [1, 2]
    old_key, old_ref = ref_logps(train_dir)

    # SFT trained again: other weights, same path, same file size
    weights = load_file(str(sft_model / "model.safetensors"))
    name = next(n for n in weights if "embed" in n)
    weights[name] = weights[name] * 1.5
    save_file(weights, str(sft_model / "model.safetensors"), metadata={"format": "pt"})

    pipeline.train(job / "run.json", 2, log)
    text = log.read_text()
    assert "configuration changed; moved old checkpoints to" in text
    assert "the policy model's content changed: sha256" in text and "the reference model's content changed" in text
    assert (train_dir / "checkpoints.previous").exists()
    assert train_steps(train_dir) == [1, 2]  # every step trained again, not 0 steps resumed
    summary = json.loads((train_dir / "summary.json").read_text())
    assert "resumed from" not in text.split("configuration changed")[-1]
    new_key, new_ref = ref_logps(train_dir)
    now = identity.run_inputs(cfg)
    assert new_key["ref_sha256"] == now["ref"] != old_key["ref_sha256"]
    assert new_ref.shape == old_ref.shape and (new_ref - old_ref).abs().max() > 1e-3  # computed again
    assert json.loads((train_dir / "run.resolved.json").read_text())["inputs"] == now
    assert (job / "run.json").read_text() == run_json  # select_config's output untouched
    assert summary["trained_candidate"] == cfg.cand.id
