"""The demo's multi-turn chat data (data/demo/chat_sft.jsonl, chat_dpo.jsonl): what the generator
writes, byte for byte, and what memfit prepares from it with the demo tokenizer: every row kept,
every assistant turn of a conversation scored, each pair's prompt the whole earlier conversation."""

from __future__ import annotations

import json
from pathlib import Path

from memfit import data
from memfit.workflow import demo_chat

DEMO = Path(__file__).resolve().parents[1] / "data" / "demo"
MAX_LEN = 96  # the longest shipped conversation renders as 80 tokens with the demo template


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DEMO / name).read_text().splitlines()]


def test_the_shipped_chat_files_are_what_the_generator_writes(tmp_path):
    demo_chat.main(["--out", str(tmp_path)])
    for name in ("chat_sft.jsonl", "chat_dpo.jsonl"):
        assert (tmp_path / name).read_bytes() == (DEMO / name).read_bytes(), name


def test_chat_sft_prepares_every_conversation_and_scores_every_answer(tok_dir, tok, tmp_path):
    rows = _rows("chat_sft.jsonl")
    assert len(rows) == demo_chat.N_CHAT_SFT == 320
    stats = data.prepare("sft", DEMO / "chat_sft.jsonl", tok_dir, tmp_path / "sft", max_len=MAX_LEN, seed=0)
    assert stats["assistant_loss"] == "all"
    assert sum(stats["rows_kept"].values()) == 320 and not any(stats["dropped"].values())
    assert not any(stats["truncated"].values())
    prepared = data.load_split(tmp_path / "sft", "train") + data.load_split(tmp_path / "sft", "eval")
    assert len(prepared) == 320
    for row in prepared:
        answers = [t["content"] for t in rows[row["row"] - 1]["messages"] if t["role"] == "assistant"]
        assert len(answers) == demo_chat.EXCHANGES
        spans, cur = [], []
        for x, y in zip(row["input_ids"], row["labels"], strict=True):
            if y != data.IGNORE_INDEX:
                assert x == y
                cur.append(x)
            elif cur:
                spans.append(tok.decode(cur))
                cur = []
        spans += [tok.decode(cur)] if cur else []
        assert spans == [f"{a}{tok.eos_token}" for a in answers], row["row"]


def test_chat_dpo_pairs_prepare_with_the_earlier_turns_as_prompt(tok_dir, tok, tmp_path):
    rows = _rows("chat_dpo.jsonl")
    assert len(rows) == demo_chat.N_CHAT_DPO == 192
    stats = data.prepare("dpo", DEMO / "chat_dpo.jsonl", tok_dir, tmp_path / "dpo", max_len=MAX_LEN, seed=0)
    assert sum(stats["rows_kept"].values()) == 192 and not any(stats["dropped"].values())
    prepared = data.load_split(tmp_path / "dpo", "train") + data.load_split(tmp_path / "dpo", "eval")
    assert len(prepared) == 192
    for pair in prepared:
        row = rows[pair["row"] - 1]
        assert [t["role"] for t in row["prompt"]][-5:] == ["user", "assistant", "user", "assistant", "user"]
        text = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        assert pair["prompt_ids"] == tok(text, add_special_tokens=False)["input_ids"]
        chosen, rejected = row["chosen"][0]["content"], row["rejected"][0]["content"]
        assert chosen != rejected
        assert tok.decode(pair["chosen_ids"]) == f"{chosen}{tok.eos_token}"
        assert tok.decode(pair["rejected_ids"]) == f"{rejected}{tok.eos_token}"
