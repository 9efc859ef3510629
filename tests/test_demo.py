"""The embedded demo: bundled data, tokenizer, tiny model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from memfit.workflow import demo

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
    for name in ("sft.jsonl", "dpo.jsonl", "rm.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), name


def _parse(prompt: str) -> tuple[str, tuple[int, ...]]:
    """The task and its numbers, read back from the prompt text."""
    numbers = tuple(int(n) for n in re.findall(r"\d+", prompt))
    for task, words in (
        ("larger", ("larger", "bigger")),
        ("smaller", ("smaller", "less")),
        ("after", ("after", "follows")),
        ("before", ("before", "precedes")),
    ):
        if any(w in prompt for w in words):
            return task, numbers
    raise AssertionError(prompt)


def _solve(prompt: str) -> int:
    task, numbers = _parse(prompt)
    return {"larger": max, "smaller": min, "after": lambda n: n[0] + 1, "before": lambda n: n[0] - 1}[task](numbers)


def _problem_keys(rows: list[dict]) -> list[tuple]:
    """(task, numbers), the two numbers of a comparison in order: "a or b" is "b or a"."""
    keys = []
    for r in rows:
        task, numbers = _parse(r["prompt"])
        keys.append((task, tuple(sorted(numbers)) if task in ("larger", "smaller") else numbers))
    return keys


def test_sft_rows_are_correct_unique_problems():
    rows = _rows("sft.jsonl")
    assert len(rows) == demo.N_SFT == 5600
    assert all(set(r) == {"prompt", "response"} for r in rows)
    assert all(r["response"] == str(_solve(r["prompt"])) for r in rows)
    keys = _problem_keys(rows)
    assert len(set(keys)) == len(rows)
    # every task is there, in its share
    counts = {t: sum(k[0] == t for k in keys) for t in demo.TASKS}
    assert counts == {t: demo.N_SFT * demo.TASK_SHARE[t] // 8 for t in demo.TASKS}
    for task, numbers in keys:
        lo, hi = demo.COUNT_RANGE if task in ("after", "before") else demo.COMPARE_RANGE
        assert all(lo <= n <= hi for n in numbers)
        if task in ("larger", "smaller"):
            assert numbers[0] != numbers[1]


def test_dpo_rows_prefer_the_right_answer_over_a_plausible_mistake():
    rows = _rows("dpo.jsonl")
    assert len(rows) == demo.N_DPO == 1600
    kinds = set()
    for r in rows:
        assert set(r) == {"prompt", "chosen", "rejected"}
        task, numbers = _parse(r["prompt"])
        right = _solve(r["prompt"])
        assert r["chosen"] == str(right)
        wrong = int(r["rejected"])
        assert wrong != right and wrong >= 0
        if task in ("larger", "smaller"):
            assert wrong == sum(numbers) - right  # the other number
        else:
            n = numbers[0]
            step = right - n
            # the number itself, a step the wrong way, two steps, a forgotten carry/borrow
            kind = {n: "same", n - step: "wrong_way", n + 2 * step: "two_steps", n - 9 * step: "carry"}[wrong]
            if kind == "carry":
                assert n % 10 == (9 if step == 1 else 0)
            kinds.add(kind)
    assert kinds == {"same", "wrong_way", "two_steps", "carry"}


def test_dpo_problems_are_disjoint_from_sft_problems():
    # DPO's held-out pairs must be problems the SFT model never trained on
    sft, dpo = _problem_keys(_rows("sft.jsonl")), _problem_keys(_rows("dpo.jsonl"))
    assert len(set(dpo)) == len(dpo)
    assert not set(sft) & set(dpo)


def test_model_and_tokenizer_load_with_auto_classes(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    model = AutoModelForCausalLM.from_pretrained(built)
    assert model.config.model_type == "llama"
    assert model.config.vocab_size == len(tok)
    assert model.config.tie_word_embeddings
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )
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
    batch = tok(
        ["<|bos|><|user|>1 + 1 = ?<|assistant|>2<|eos|>", "<|bos|><|user|>9 - 9 = ?"],
        add_special_tokens=False,
        padding=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        out = model(**batch, labels=batch["input_ids"])
    assert out.logits.shape == (*batch["input_ids"].shape, len(tok))
    assert torch.isfinite(out.loss) and 4.0 < out.loss.item() < 7.0  # ~ln(vocab) at random init


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
