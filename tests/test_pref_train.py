"""rm, ORPO, SimPO and KTO trained end to end by memfit's launcher: 2 CPU ranks (gloo), the demo
model, data prepared by `memfit.data.prepare`, checkpoints, held-out evaluations, exports, and a
KTO run killed and resumed bit for bit."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from deepspeed_runs import run, run_side_by_side
from safetensors.torch import load_file

from memfit.data import prepare
from memfit.train.run_config import RunConfig

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def _config(demo_model, data: Path, out: Path, method: str, steps: int = 6, **cand) -> RunConfig:
    """A few steps of `method` (micro batch 8 on 2 ranks), an evaluation and a checkpoint every 3."""
    return RunConfig(
        method=method,
        model_path=str(demo_model),
        data_dir=str(data),
        out_dir=str(out),
        candidate={"zero": 2, "precision": "fp32", "seq_len": 32, "micro_batch": 8, "grad_accum": 1, "ref": None}
        | cand,
        max_steps=steps,
        lr=3e-3,
        warmup_steps=1,
        save_every=3,
        eval_every=3,
        log_every=1,
    )


@pytest.fixture(scope="module")
def pref_data(demo_model, tmp_path_factory) -> Path:
    """The demo's pairs prepared for orpo, simpo and kto (kto: each pair converted to a desirable
    and an undesirable row), and a reward-model set whose preference a few steps can learn: every
    chosen answer ends with "yes", every rejected one with "no"."""
    root = tmp_path_factory.mktemp("pref")
    src = root / "pairs.jsonl"
    src.write_text("".join((REPO / "data/demo/dpo.jsonl").read_text().splitlines(keepends=True)[:480]))
    for method in ("orpo", "simpo"):
        prepare(method, src, demo_model, root / method, max_len=32, eval_fraction=0.05)
    kto_src = root / "kto.jsonl"  # fewer rows: a precomputed reference scores every one of them
    kto_src.write_text("".join(src.read_text().splitlines(keepends=True)[:160]))
    prepare("kto", kto_src, demo_model, root / "kto", max_len=32, eval_fraction=0.1)
    rm_src = root / "rm.jsonl"
    with rm_src.open("w") as f:
        for line in src.read_text().splitlines():
            pair = json.loads(line)
            pair["chosen"], pair["rejected"] = pair["chosen"] + " yes", pair["rejected"] + " no"
            f.write(json.dumps(pair) + "\n")
    prepare("rm", rm_src, demo_model, root / "rm", max_len=32, eval_fraction=0.1)
    return root


@pytest.fixture(scope="module")
def kto_runs(demo_model, pref_data, tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    """KTO with a precomputed reference, 4 steps (checkpoints at 2 and 4): "full" uninterrupted,
    "killed" the same run stopped after step 3 (`stop_after_step`: its newest checkpoint is step 2),
    side by side."""
    root = tmp_path_factory.mktemp("kto")
    cfg = _config(demo_model, pref_data / "kto", root / "full", "kto", steps=4, ref="precomputed")
    cfg.save_every = cfg.eval_every = 2
    killed = dataclasses.replace(cfg, out_dir=str(root / "killed"), stop_after_step=3)
    full_rows, killed_rows = run_side_by_side(cfg, killed)
    return {"full": (root / "full", full_rows), "killed": (root / "killed", killed_rows)}


def _train(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["split"] == "train"]


def test_reward_model_learns_held_out_pairs_and_exports_a_classifier(demo_model, pref_data, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path / "rm"
    rows = run(_config(demo_model, pref_data / "rm", out, "rm"))
    evals = [r for r in rows if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [0, 3, 6]
    assert {"loss", "accuracy", "margin", "mean_reward"} <= set(evals[-1])  # TRL RewardTrainer's names
    assert evals[-1]["accuracy"] >= 0.9, evals  # chance is 0.5
    assert evals[-1]["margin"] > evals[0]["margin"] and evals[-1]["loss"] < evals[0]["loss"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step"))[-1:] == ["step00000006"]
    # the export is a one-output sequence classifier: it ranks a held-out pair as training did
    model = AutoModelForSequenceClassification.from_pretrained(out / "model").eval()
    tok = AutoTokenizer.from_pretrained(out / "model")
    assert model.config.num_labels == 1 and model.config.pad_token_id == tok.pad_token_id
    pair = json.loads((pref_data / "rm.jsonl").read_text().splitlines()[0])
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": pair["prompt"]}], tokenize=False, add_generation_prompt=True
    )
    with torch.no_grad():
        scores = [
            model(**tok(prompt + pair[k] + tok.eos_token, add_special_tokens=False, return_tensors="pt")).logits.item()
            for k in ("chosen", "rejected")
        ]
    assert scores[0] > scores[1]


@pytest.mark.parametrize("method", ["orpo", "simpo"])
def test_orpo_and_simpo_train_with_trl_metrics(demo_model, pref_data, tmp_path, method):
    out = tmp_path / method
    rows = run(_config(demo_model, pref_data / method, out, method))
    train = _train(rows)
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    names = {"loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"}
    assert names <= set(train[-1])
    if method == "orpo":
        assert {"nll_loss", "log_odds_ratio", "log_odds_chosen"} <= set(train[-1])
    evals = [r for r in rows if r["split"] == "eval"]
    assert evals[-1]["loss"] < evals[0]["loss"], evals
    assert (out / "model/model.safetensors").exists() and (out / "checkpoints").is_dir()


def test_kto_trains_with_a_precomputed_reference(kto_runs):
    out, rows = kto_runs["full"]
    train = _train(rows)
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert {"loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen"} <= set(train[-1])
    assert not any(k.endswith("_sum") or k.startswith("count/") for k in train[-1])  # finish_metrics ran
    assert train[0]["kl"] == 0.0  # the policy starts as the reference: z0 = max(0, 0)
    assert all(0 <= r["loss"] <= 1 for r in train)  # lambda_y * (1 - sigma): both weights 1
    assert any(r["kl"] > 0 for r in train[1:])  # the policy left the reference
    evals = [r for r in rows if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 4] and evals[0]["rewards/margins"] == 0.0
    assert evals[-1]["logps/chosen"] != evals[0]["logps/chosen"]
    assert json.loads((out / "summary.json").read_text())["steps"] == 4


def test_kto_killed_and_resumed_equals_the_uninterrupted_run(kto_runs):
    ref_dir, ref_rows = kto_runs["full"]
    out, first = kto_runs["killed"]
    assert max(r["step"] for r in first) == 3 and not (out / "model").exists()
    cfg = RunConfig.load(out / "run.json")
    rows = run(dataclasses.replace(cfg, stop_after_step=None))  # relaunched: resumes from step 2
    assert [r["step"] for r in _train(rows)] == [1, 2, 3, 4]  # metrics.jsonl cut back to the checkpoint
    assert [r.get("resumed_from_step") for r in _train(rows)] == [None, None, 2, None]
    for key in ("loss", "kl", "rewards/chosen", "grad_norm"):  # bit for bit
        assert [r[key] for r in _train(rows)] == [r[key] for r in _train(ref_rows)], key
    assert [r["loss"] for r in rows if r["split"] == "eval"] == [r["loss"] for r in ref_rows if r["split"] == "eval"]
    a = load_file(str(ref_dir / "model/model.safetensors"))
    b = load_file(str(out / "model/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_reward_model_with_lora_trains_its_score_head_and_exports_merged(demo_model, pref_data, tmp_path):
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "rm-lora"
    cfg = _config(demo_model, pref_data / "rm", out, "rm", steps=3, finetune="lora", lora_rank=8)
    rows = run(cfg)
    assert [r["step"] for r in _train(rows)] == [1, 2, 3] and all(r["grad_norm"] > 0 for r in _train(rows))
    model = AutoModelForSequenceClassification.from_pretrained(out / "model")
    assert model.config.num_labels == 1 and not any("lora" in k for k in model.state_dict())
    # the score head trained beside the adapters (peft's modules_to_save): its reward margin grew
    evals = [r for r in rows if r["split"] == "eval"]
    assert evals[-1]["margin"] > evals[0]["margin"], evals
