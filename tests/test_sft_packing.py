"""SFT options without DeepSpeed: loss_on (response | all) and packing (rows packed into sequences
whose attention never crosses a row boundary), checked against the HF model's own forward."""

from __future__ import annotations

import copy

import pytest
import torch
import yaml

from memfit import data
from memfit.train.batches import collate, collate_packed
from memfit.train.losses import IGNORE_INDEX, sft_loss, token_logps
from memfit.train.run_config import RunConfig


@pytest.fixture(scope="module")
def sft_rows(demo_model, tmp_path_factory, repo):
    out = tmp_path_factory.mktemp("sft") / "prepared"
    data.prepare("sft", repo / "data/demo/sft.jsonl", demo_model, out, max_len=32, eval_fraction=0.0)
    return data.load_split(out, "train")


def model_with(demo_model, attn: str):
    """The model as the trainer loads it (fp32, use_cache off: with a KV cache transformers
    ignores position_ids for packing, masking_utils._preprocess_mask_arguments)."""
    from memfit.space import Candidate
    from memfit.train.modeling import load_model

    return load_model(str(demo_model), Candidate.from_dict({"attn": attn, "precision": "fp32"}), trainable=False)


def mixed_rows(rows, n=9):
    """Rows of different lengths (packing is only interesting when they differ)."""
    by_len = {}
    for r in rows:
        by_len.setdefault(len(r["input_ids"]), r)
    picked = list(by_len.values())
    return (picked * n)[:n] if len(picked) < n else picked[:n]


# ---------------------------------------------------------------------------- loss_on


def test_loss_on_all_equals_the_hf_loss_with_unmasked_labels(demo_model, sft_rows):
    model = model_with(demo_model, "sdpa")
    rows = mixed_rows(sft_rows, 4)
    batch = collate("sft", rows, pad_id=0, loss_on="all")
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE_INDEX).all()  # padding never scored
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        hf_labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
        hf = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=hf_labels).loss
    ours, n = sft_loss(logits, batch["labels"])
    assert n == sum(len(r["input_ids"]) - 1 for r in rows)  # every token but each row's first
    assert float(ours) == pytest.approx(float(hf), abs=1e-5)
    response, n_resp = sft_loss(logits, collate("sft", rows, pad_id=0)["labels"])
    assert n_resp < n and float(response) != pytest.approx(float(ours), abs=1e-3)


def test_loss_on_response_ignores_the_prompt_tokens(demo_model, sft_rows):
    model = model_with(demo_model, "sdpa")
    rows = mixed_rows(sft_rows, 4)
    batch = collate("sft", rows, pad_id=0)  # loss_on="response", the default
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        hf = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    loss, n = sft_loss(logits, batch["labels"])
    assert float(loss) == pytest.approx(float(hf), abs=1e-5)
    # whatever the model predicts where the next token is a prompt token (or padding) changes nothing
    targets_prompt = torch.zeros_like(batch["labels"], dtype=torch.bool)
    targets_prompt[:, :-1] = batch["labels"][:, 1:] == IGNORE_INDEX
    noisy = logits + 50 * torch.randn_like(logits) * targets_prompt.unsqueeze(-1)
    assert targets_prompt.sum() > 0
    assert float(sft_loss(noisy, batch["labels"])[0]) == float(loss)
    # ... and the response positions do count
    targets_resp = ~targets_prompt
    targets_resp[:, -1] = False
    assert float(
        sft_loss(logits + 5 * torch.randn_like(logits) * targets_resp.unsqueeze(-1), batch["labels"])[0]
    ) != float(loss)
    assert n == sum(sum(y != IGNORE_INDEX for y in r["labels"]) for r in rows)


# ---------------------------------------------------------------------------- packing


def test_pack_is_deterministic_complete_and_within_capacity(sft_rows):
    lengths = [len(r["input_ids"]) for r in sft_rows]  # 14, 15 and 18 tokens
    packs = data.pack(lengths, 128, seed=0)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))  # every row exactly once
    assert all(sum(lengths[i] for i in p) <= 128 for p in packs)
    assert data.pack(lengths, 128, seed=0) == packs
    assert data.pack(lengths, 128, seed=1) != packs  # ties broken by the seed
    fill = sum(lengths) / (len(packs) * 128)
    assert fill > 0.95, fill  # best-fit decreasing leaves little room on these short rows
    # best fit: the 14 fills an 18's pack exactly (32) rather than the 15s' (30)
    small = [18, 15, 15, 14, 18]
    assert sorted(sum(small[i] for i in p) for p in data.pack(small, 32, seed=0)) == [18, 30, 32]
    with pytest.raises(ValueError, match="packing needs 1..8"):
        data.pack(lengths, 8, seed=0)


def test_collate_packed_positions_labels_and_padding():
    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9], "labels": [-100, 9]}]
    b = collate_packed([rows, rows[:1]], pad_id=0, pad_to=6)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0], [5, 6, 7, 0, 0, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 0, 1, 2]]
    assert b["labels"].tolist() == [[-100, 6, 7, -100, 9, -100], [-100, 6, 7, -100, -100, -100]]
    assert "attention_mask" not in b  # transformers reads packing from position_ids only without a mask
    b = collate_packed([rows], pad_id=0, loss_on="all")
    assert b["labels"].tolist() == [[-100, 6, 7, -100, 9]]  # a row's first token is never a target
    flat = collate_packed([rows, rows[:1]], pad_id=0, pad_to=6, flatten=True)
    assert flat["position_ids"].shape == (1, 12)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("loss_on", ["response", "all"])
def test_packed_batch_equals_the_rows_run_unpacked(demo_model, sft_rows, attn, loss_on):
    """Per-row token log-probs and the loss of a packed batch equal the unpacked ones (fp32)."""
    model = model_with(demo_model, attn)
    rows = mixed_rows(sft_rows, 9)
    lengths = [len(r["input_ids"]) for r in rows]
    packs = [[rows[i] for i in p] for p in data.pack(lengths, 40, seed=0)]
    assert max(len(p) for p in packs) >= 2  # several rows share a sequence
    with torch.no_grad():
        unpacked = {}
        for r in rows:  # one row at a time, no padding: the reference
            b = collate("sft", [r], pad_id=0, loss_on=loss_on)
            logps, mask = token_logps(model(input_ids=b["input_ids"], use_cache=False).logits, b["labels"])
            unpacked[id(r)] = (logps[0], mask[0])
        padded = collate("sft", rows, pad_id=0, loss_on=loss_on)
        ref_loss, ref_n = sft_loss(
            model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits, padded["labels"]
        )
        layouts = [False, True]  # [B, L] (sdpa/eager) and the flattened [1, B*L] used for flash
        for flatten in layouts:
            b = collate_packed(packs, pad_id=0, pad_to=40, loss_on=loss_on, flatten=flatten)
            logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
            logps, mask = token_logps(logits, b["labels"])
            loss, n = sft_loss(logits, b["labels"])
            assert n == ref_n
            assert float(loss) == pytest.approx(float(ref_loss), abs=1e-5)
            for k, p in enumerate(packs):
                row, start = (0, k * 40) if flatten else (k, 0)  # flattened: pack k at k * pad_to
                for r in p:
                    n_r = len(r["input_ids"])
                    # token_logps drops the first position: entry t scores token t+1
                    got = logps[row, start : start + n_r - 1]
                    got_mask = mask[row, start : start + n_r - 1]
                    want, want_mask = unpacked[id(r)]
                    assert torch.equal(got_mask, want_mask)
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
                    start += n_r


def test_packing_without_position_ids_would_leak_across_rows(demo_model, sft_rows):
    """The equality above is not vacuous: the same packs run as plain causal sequences differ."""
    model = model_with(demo_model, "sdpa")
    rows = mixed_rows(sft_rows, 9)
    packs = [[rows[i] for i in p] for p in data.pack([len(r["input_ids"]) for r in rows], 40, seed=0)]
    b = collate_packed(packs, pad_id=0, pad_to=40)
    padded = collate("sft", rows, pad_id=0)
    with torch.no_grad():
        ref = sft_loss(
            model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits, padded["labels"]
        )[0]
        leaky = sft_loss(model(input_ids=b["input_ids"]).logits, b["labels"])[0]
    assert abs(float(leaky) - float(ref)) > 1e-3


# ---------------------------------------------------------------------------- config errors


def _run(method="sft", **kw):
    return RunConfig(
        method=method,
        model_path="m",
        data_dir="d",
        out_dir="o",
        candidate={"finetune": kw.pop("finetune", "full"), "lora_rank": 8},
        **kw,
    )


def test_run_config_refuses_invalid_combinations():
    _run(packing=True, loss_on="all")
    _run(finetune="lora", export_format="adapter")
    with pytest.raises(ValueError, match=r"train\.dpo\.packing: packing applies to sft only"):
        _run("dpo", packing=True)
    with pytest.raises(ValueError, match=r"train\.dpo\.loss_on: 'all' applies to sft only"):
        _run("dpo", loss_on="all")
    with pytest.raises(ValueError, match=r"train\.sft\.export: 'adapter' needs finetune lora or qlora"):
        _run(export_format="adapter")
    with pytest.raises(ValueError, match=r"train\.sft\.loss_on: 'prompt' is not allowed"):
        _run(loss_on="prompt")


@pytest.fixture()
def config(repo, monkeypatch):
    monkeypatch.chdir(repo)
    return yaml.safe_load((repo / "config/config.yaml").read_text())


def test_workflow_config_passes_the_new_keys_through(config, tmp_path):
    from memfit.workflow.config import WorkflowConfig

    cfg = copy.deepcopy(config)
    cfg["train"]["sft"].update(packing=True, loss_on="all")
    cfg["search"]["finetune"] = ["lora"]
    cfg["train"]["sft"]["export"] = "adapter"
    run = WorkflowConfig.load(cfg).run_config("sft", {"finetune": "lora", "lora_rank": 8}, "m", "d", str(tmp_path))
    assert (run.packing, run.loss_on, run.export_format) == (True, "all", "adapter")
    assert RunConfig.load(run.save(tmp_path / "run.json") or tmp_path / "run.json") == run


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda c: c["train"]["dpo"].update(packing=True), r"train\.dpo\.packing: packing applies to sft only"),
        (
            lambda c: c["train"]["sft"].update(export="adapter"),
            r"train\.sft\.export: 'adapter' needs finetune lora or qlora \(search\.finetune lists full",
        ),
        (
            lambda c: c["train"]["sft"].update(loss_on="prompt"),
            r"train\.sft\.loss_on: 'prompt' is not allowed \(allowed: 'response', 'all'\)",
        ),
        (lambda c: c["train"]["sft"].update(packing="yes"), r"train\.sft\.packing: 'yes' is not of type 'boolean'"),
    ],
)
def test_bad_sft_options_name_the_key(config, change, expected):
    from memfit.workflow.config import ConfigError, validate_config

    bad = copy.deepcopy(config)
    change(bad)
    with pytest.raises(ConfigError, match=expected):
        validate_config(bad)
