"""The embedded demo: bundled data, tokenizer, tiny model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from memfit import demo

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "demo"
CONFIG = REPO / "config" / "models" / "demo-tiny.json"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return demo.build_demo_model(CONFIG, DATA, tmp_path_factory.mktemp("m") / "demo-tiny")


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


def test_regenerating_data_reproduces_committed_files(tmp_path):
    assert demo.main(["data", "--out", str(tmp_path)]) == 0
    for name in ("sft.jsonl", "dpo.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), name


def _solve(prompt: str) -> int:
    a, op, b = re.search(r"(\d+) ([+-]) (\d+)", prompt).groups()
    return int(a) + int(b) if op == "+" else int(a) - int(b)


def test_sft_rows_are_correct_unique_arithmetic():
    rows = _rows("sft.jsonl")
    assert len(rows) == demo.N_SFT == 3000
    assert all(set(r) == {"prompt", "response"} for r in rows)
    assert all(int(r["response"]) == _solve(r["prompt"]) >= 0 for r in rows)
    assert len({re.search(r"\d+ [+-] \d+", r["prompt"]).group() for r in rows}) == len(rows)


def test_dpo_rows_prefer_the_right_answer_over_a_plausible_mistake():
    rows = _rows("dpo.jsonl")
    assert len(rows) == demo.N_DPO == 3000
    for r in rows:
        right = _solve(r["prompt"])
        assert int(r["chosen"]) == right
        wrong = int(r["rejected"])
        assert wrong != right and wrong >= 0
        # off by one, a carry/borrow error (10), or swapped digits
        assert abs(wrong - right) in (1, 10) or str(wrong) == str(right)[::-1]


def test_model_and_tokenizer_load_with_auto_classes(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    model = AutoModelForCausalLM.from_pretrained(built)
    assert model.config.model_type == "llama"
    assert model.config.vocab_size == len(tok)
    assert model.config.tie_word_embeddings
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    n_params = sum(p.numel() for p in model.parameters())
    assert 2_000_000 < n_params < 4_000_000
    # the committed JSON carries what the build fills in, so the estimator can read it as is
    committed = json.loads(CONFIG.read_text())
    assert committed["vocab_size"] == len(tok)
    assert committed["pad_token_id"] == tok.pad_token_id


def test_tokenizer_digits_and_chat_template(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    ids = tok("12 + 305", add_special_tokens=False)["input_ids"]
    tokens = tok.convert_ids_to_tokens(ids)
    assert [t for t in tokens if any(c.isdigit() for c in t)] == list("12305")
    assert tok.decode(ids) == "12 + 305"
    messages = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
    prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|bos|><|user|>What is 2 + 3?<|assistant|>"
    full = tok.apply_chat_template(messages, tokenize=False)
    assert full == prompt + "5<|eos|>"
    # prompt ids + response ids + EOS == ids of the whole conversation (memfit.data relies on it)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert enc(full) == enc(prompt) + enc("5") + [tok.eos_token_id]


def test_forward_pass_gives_finite_loss(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    model = AutoModelForCausalLM.from_pretrained(built)
    batch = tok(["<|bos|><|user|>1 + 1 = ?<|assistant|>2<|eos|>", "<|bos|><|user|>9 - 9 = ?"],
                add_special_tokens=False, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**batch, labels=batch["input_ids"])
    assert out.logits.shape == (*batch["input_ids"].shape, len(tok))
    assert torch.isfinite(out.loss) and 4.0 < out.loss.item() < 7.0  # ~ln(277) at random init


def test_rebuild_is_byte_identical_and_atomic(built, tmp_path):
    again = demo.build_demo_model(CONFIG, DATA, tmp_path / "demo-tiny")
    names = sorted(p.name for p in built.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    assert "model.safetensors" in names
    for name in names:
        assert (built / name).read_bytes() == (again / name).read_bytes(), name
    # rebuilding over an existing directory replaces it and leaves no temporaries behind
    demo.build_demo_model(CONFIG, DATA, tmp_path / "demo-tiny")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-tiny"]


def test_build_does_not_disturb_the_callers_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    demo.build_demo_model(CONFIG, DATA, tmp_path / "m")
    assert torch.equal(torch.rand(3), expected)
