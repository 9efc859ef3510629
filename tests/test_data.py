"""memfit.data: the prepare_data contract (columns, masking, counts, errors, formats)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from memfit import data
from memfit.workflow import demo

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "data" / "demo"


@pytest.fixture(scope="module")
def sft_out(tok_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sft") / "prepared"
    data.prepare("sft", DEMO / "sft.jsonl", tok_dir, out, max_len=64, eval_fraction=0.1, seed=0)
    return out


@pytest.fixture(scope="module")
def dpo_out(tok_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dpo") / "prepared"
    data.prepare("dpo", DEMO / "dpo.jsonl", tok_dir, out, max_len=64, eval_fraction=0.1, seed=0)
    return out


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _stats(out: Path) -> dict:
    return json.loads((out / "stats.json").read_text())


def _prompt_ids(tok, messages: list[dict]) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------- the demo data, SFT/DPO


def test_sft_columns_and_exact_prompt_mask(sft_out, tok):
    assert sorted(p.name for p in sft_out.iterdir()) == ["eval.parquet", "stats.json", "train.parquet"]
    source = [json.loads(line) for line in (DEMO / "sft.jsonl").read_text().splitlines()]
    for split in ("train", "eval"):
        assert pq.read_schema(sft_out / f"{split}.parquet").remove_metadata() == data.SCHEMAS["sft"]
    rows = data.load_split(sft_out, "train") + data.load_split(sft_out, "eval")
    assert sorted(r["row"] for r in rows) == list(range(1, len(source) + 1))
    for r in rows[:300]:
        src = source[r["row"] - 1]
        prompt = _prompt_ids(tok, [{"role": "user", "content": src["prompt"]}])
        k = len(prompt)
        assert r["input_ids"][:k] == prompt
        assert r["labels"][:k] == [-100] * k
        assert r["labels"][k:] == r["input_ids"][k:]
        assert tok.decode(r["input_ids"][k:]) == src["response"] + tok.eos_token
        assert r["length"] == len(r["input_ids"]) == len(r["labels"])


def test_sft_stats(sft_out):
    s = _stats(sft_out)
    assert (s["method"], s["max_len"], s["rows_read"]) == ("sft", 64, 5600)
    assert s["rows_kept"] == {"train": 5040, "eval": 560}
    assert set(s["dropped"]) == set(data.DROP_REASONS["sft"]) and sum(s["dropped"].values()) == 0
    assert s["truncated"] == {"response": 0}
    train = data.load_split(sft_out, "train")
    lengths = [r["length"] for r in train]
    worst = s["worst_case_rows"]
    assert len(worst) == min(len(train), data.WORST_CASE_ROWS) >= 64
    assert [lengths[i] for i in worst] == sorted(lengths, reverse=True)[: len(worst)]
    assert s["length"]["max"] == max(lengths) and s["length"]["min"] <= s["length"]["p50"]
    # p0..p100 of every kept row's length, each a real row length: what prices a padded micro batch
    both = sorted(lengths + [r["length"] for r in data.load_split(sft_out, "eval")])
    q = s["length"]["quantiles"]
    assert len(q) == 101 and (q[0], q[50], q[99], q[100]) == (both[0], s["length"]["p50"], s["length"]["p99"], both[-1])
    assert q == sorted(q) and set(q) <= set(both)
    assert s["tokens"] == s["tokens_by_split"]["train"] + s["tokens_by_split"]["eval"]
    assert s["tokens_by_split"]["train"] == sum(lengths)


def test_dpo_columns_lengths_and_eos(dpo_out, tok):
    for split in ("train", "eval"):
        assert pq.read_schema(dpo_out / f"{split}.parquet").remove_metadata() == data.SCHEMAS["dpo"]
    s = _stats(dpo_out)
    source = [json.loads(line) for line in (DEMO / "dpo.jsonl").read_text().splitlines()]
    assert s["rows_read"] == len(source) == 1600 and sum(s["rows_kept"].values()) == 1600
    for r in data.load_split(dpo_out, "eval"):
        src = source[r["row"] - 1]
        assert r["prompt_ids"] == _prompt_ids(tok, [{"role": "user", "content": src["prompt"]}])
        assert tok.decode(r["chosen_ids"]) == src["chosen"] + tok.eos_token
        assert tok.decode(r["rejected_ids"]) == src["rejected"] + tok.eos_token
        assert r["length"] == len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"]))


def test_worst_case_batch(dpo_out):
    train = data.load_split(dpo_out, "train")
    longest = max(r["length"] for r in train)
    batch = data.worst_case_batch(dpo_out, 4)
    assert len(batch) == 4 and all(r["length"] == longest for r in batch)
    assert [r["row"] for r in batch] == [train[i]["row"] for i in _stats(dpo_out)["worst_case_rows"][:4]]


def test_worst_case_batch_repeats_rows_when_train_is_small(tok_dir, tmp_path):
    src = _jsonl(tmp_path / "s.jsonl", [{"prompt": "1 + 1", "response": "2"}, {"prompt": "1 + 1", "response": "2 2 2"}])
    data.prepare("sft", src, tok_dir, tmp_path / "o", max_len=64, eval_fraction=0.0, seed=0)
    assert [r["row"] for r in data.worst_case_batch(tmp_path / "o", 5)] == [2, 1, 2, 1, 2]


# --------------------------------------------------------------------------------- split


def test_split_is_deterministic_grouped_by_prompt_and_seeded(tok_dir, tmp_path):
    rows = [{"prompt": f"q{i % 50}", "chosen": "a", "rejected": f"b{i}"} for i in range(200)]
    src = _jsonl(tmp_path / "d.jsonl", rows)

    def eval_rows(seed: int, name: str) -> list[int]:
        data.prepare("dpo", src, tok_dir, tmp_path / name, max_len=32, eval_fraction=0.2, seed=seed)
        return [r["row"] for r in data.load_split(tmp_path / name, "eval")]

    first, again, other = eval_rows(0, "a"), eval_rows(0, "b"), eval_rows(1, "c")
    assert first == again != other
    assert (tmp_path / "a" / "train.parquet").read_bytes() == (tmp_path / "b" / "train.parquet").read_bytes()
    prompts = {(r - 1) % 50 for r in first}
    assert len(prompts) == 10 and len(first) == 40  # 20% of 50 prompts, all 4 rows of each
    train = {(r["row"] - 1) % 50 for r in data.load_split(tmp_path / "a", "train")}
    assert not prompts & train


def test_zero_eval_fraction_writes_an_empty_eval_split(tok_dir, tmp_path):
    src = _jsonl(tmp_path / "s.jsonl", [{"prompt": "p", "response": "r"}] * 3)
    s = data.prepare("sft", src, tok_dir, tmp_path / "o", max_len=32, eval_fraction=0.0, seed=0)
    assert s["rows_kept"] == {"train": 3, "eval": 0}
    assert pq.read_table(tmp_path / "o" / "eval.parquet").schema.remove_metadata() == data.SCHEMAS["sft"]


# ------------------------------------------------------------------ drops and truncation


def test_sft_drops_and_truncations_are_counted(tok_dir, tok, tmp_path):
    prompt_len = len(_prompt_ids(tok, [{"role": "user", "content": "What is 1 + 1?"}]))
    max_len = prompt_len + 4
    src = _jsonl(
        tmp_path / "s.jsonl",
        [
            {"prompt": "What is 1 + 1?", "response": "2"},  # kept whole
            {"prompt": "What is 1 + 1?", "response": "1 2 3 4 5 6 7 8 9"},  # truncated
            "",  # blank line
            {"prompt": "What is 1 + 1?", "response": "  "},  # empty response
            {"prompt": "What is 1 + 1? " * 10, "response": "2"},  # prompt leaves no room
        ],
    )
    s = data.prepare("sft", src, tok_dir, tmp_path / "o", max_len=max_len, eval_fraction=0.0, seed=0)
    assert s["dropped"] == {"blank_line": 1, "empty_response": 1, "prompt_too_long": 1}
    assert s["truncated"] == {"response": 1}
    assert s["rows_read"] == 5 == sum(s["rows_kept"].values()) + sum(s["dropped"].values())
    rows = {r["row"]: r for r in data.load_split(tmp_path / "o", "train")}
    assert sorted(rows) == [1, 2]
    assert rows[2]["length"] == max_len and rows[2]["input_ids"][-1] != tok.eos_token_id
    assert rows[1]["input_ids"][-1] == tok.eos_token_id


def test_dpo_drops_and_truncations_are_counted(tok_dir, tok, tmp_path):
    prompt_len = len(_prompt_ids(tok, [{"role": "user", "content": "Q"}]))
    max_len = prompt_len + 3
    src = _jsonl(
        tmp_path / "d.jsonl",
        [
            {"prompt": "Q", "chosen": "12", "rejected": "13"},  # kept: 3 tokens each with EOS
            {"prompt": "Q", "chosen": "", "rejected": "13"},
            {"prompt": "Q", "chosen": "12", "rejected": " "},
            {"prompt": "Q", "chosen": "12", "rejected": "12"},
            {"prompt": "Q " * 40, "chosen": "1", "rejected": "2"},
            {"prompt": "Q", "chosen": "1234", "rejected": "1235"},  # both cut to "123": nothing to prefer
            {"prompt": "Q", "chosen": "1234", "rejected": "9"},  # chosen truncated, kept
        ],
    )
    s = data.prepare("dpo", src, tok_dir, tmp_path / "o", max_len=max_len, eval_fraction=0.0, seed=0)
    assert s["dropped"] == {
        "blank_line": 0,
        "empty_chosen": 1,
        "empty_rejected": 1,
        "identical_chosen_rejected": 1,
        "prompt_too_long": 1,
        "identical_after_truncation": 1,
    }
    assert s["truncated"] == {"chosen": 1, "rejected": 0}  # kept rows only
    rows = data.load_split(tmp_path / "o", "train")
    assert [r["row"] for r in rows] == [1, 7]
    assert all(r["length"] <= max_len for r in rows)


def test_messages_rows_with_assistant_loss_last_train_only_the_last_turn(tok_dir, tok, tmp_path):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1 + 1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "and 2 + 2?"},
        {"role": "assistant", "content": "4"},
    ]
    src = _jsonl(tmp_path / "m.jsonl", [{"messages": messages, "prompt": "ignored"}])
    data.prepare("sft", src, tok_dir, tmp_path / "o", max_len=64, eval_fraction=0.0, seed=0, assistant_loss="last")
    (row,) = data.load_split(tmp_path / "o", "train")
    k = len(_prompt_ids(tok, messages[:-1]))
    assert row["labels"][:k] == [-100] * k
    assert tok.decode(row["labels"][k:]) == "4" + tok.eos_token
    full = tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    assert row["input_ids"] == full


def test_all_rows_dropped_is_an_error_not_an_empty_dataset(tok_dir, tmp_path):
    src = _jsonl(tmp_path / "s.jsonl", [{"prompt": "p", "response": ""}])
    with pytest.raises(data.DataError, match="all 1 rows were dropped"):
        data.prepare("sft", src, tok_dir, tmp_path / "o", max_len=32, eval_fraction=0.1, seed=0)
    assert list(tmp_path.iterdir()) == [src]


# --------------------------------------------------------------------------- bad input

GOOD_DPO = {"prompt": "Q", "chosen": "1", "rejected": "2"}
BAD_INPUTS = {
    # name: (method, file bytes, line, key or None, words the message must contain)
    "missing chosen": ("dpo", [GOOD_DPO, {"prompt": "Q", "rejected": "2"}], 2, "chosen", "missing (DPO rows need"),
    "missing prompt": ("dpo", [{"chosen": "1", "rejected": "2"}], 1, "prompt", "missing (DPO rows need"),
    "missing response": ("sft", [{"prompt": "p"}], 1, "response", "missing (SFT rows need"),
    "empty prompt": ("dpo", [GOOD_DPO, GOOD_DPO, {**GOOD_DPO, "prompt": " "}], 3, "prompt", "empty"),
    "prompt not a string": ("sft", [{"prompt": 5, "response": "r"}], 1, "prompt", "expected a string, got int"),
    "null response": ("sft", [{"prompt": "p", "response": None}], 1, "response", "got null"),
    "messages last turn": (
        "sft",
        [
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "c"},
                ]
            }
        ],
        1,
        "messages[2].role",
        "the last turn must be the assistant's",
    ),
    "messages content list": (
        "sft",
        [{"messages": [{"role": "user", "content": ["a"]}, {"role": "assistant", "content": "b"}]}],
        1,
        "messages[0].content",
        "expected a string",
    ),
    "non-UTF-8 line": (
        "sft",
        [{"prompt": "p", "response": "r"}, b'{"prompt": "caf\xe9", "response": "r"}'],
        2,
        None,
        "not UTF-8",
    ),
    "CSV file": ("sft", ["prompt,response", "1 + 1,2"], 1, None, "not JSON"),
    "garbage": ("sft", [b"\x00\x01garbage\xff"], 1, None, "not UTF-8"),
    "JSON array line": ("dpo", ['[{"prompt": "Q"}]'], 1, None, "JSON object"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_names_file_line_key_and_leaves_no_output(case, tok_dir, tmp_path):
    method, lines, line, key, words = BAD_INPUTS[case]
    src = tmp_path / ("bad.csv" if case == "CSV file" else "bad.jsonl")
    src.write_bytes(
        b"".join(
            (x if isinstance(x, bytes) else (x if isinstance(x, str) else json.dumps(x)).encode()) + b"\n"
            for x in lines
        )
    )
    out = tmp_path / "out"
    with pytest.raises(data.DataError) as err:
        data.prepare(method, src, tok_dir, out, max_len=32, eval_fraction=0.1, seed=0)
    message = str(err.value)
    assert str(src) in message and f"line {line}" in message and words in message
    assert (err.value.line, err.value.key) == (line, key)
    if key is not None:
        assert f"key {key!r}" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]


def test_failed_prepare_leaves_the_previous_output_untouched(tok_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stats.json").write_text("old")
    src = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "Q", "rejected": "2"}])
    with pytest.raises(data.DataError):
        data.prepare("dpo", src, tok_dir, out, max_len=32, eval_fraction=0.1, seed=0)
    assert [p.name for p in out.iterdir()] == ["stats.json"] and (out / "stats.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "out"]


def test_parquet_type_error_names_row_and_column(tok_dir, tmp_path):
    src = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "response": ["1", None]}), src)
    with pytest.raises(data.DataError, match=r"bad.parquet, row 2, key 'response': expected a string, got null"):
        data.prepare("sft", src, tok_dir, tmp_path / "o", max_len=32, eval_fraction=0.1, seed=0)


# ----------------------------------------------------------------------- other formats


def _demo_dpo_rows() -> list[dict]:
    return [json.loads(line) for line in (DEMO / "dpo.jsonl").read_text().splitlines()][:400]


def _prepared_rows(out: Path) -> list[dict]:
    return data.load_split(out, "train") + data.load_split(out, "eval")


def test_parquet_input_matches_jsonl(tok_dir, tmp_path):
    rows = _demo_dpo_rows()
    jsonl = _jsonl(tmp_path / "d.jsonl", rows)
    parquet = tmp_path / "d.data"  # detected by content (PAR1), not by name
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    data.prepare("dpo", jsonl, tok_dir, tmp_path / "a", max_len=64, eval_fraction=0.1, seed=0)
    data.prepare("dpo", parquet, tok_dir, tmp_path / "b", max_len=64, eval_fraction=0.1, seed=0)
    assert _prepared_rows(tmp_path / "a") == _prepared_rows(tmp_path / "b")


def test_saved_hf_dataset_input_matches_jsonl(tok_dir, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = _demo_dpo_rows()
    jsonl = _jsonl(tmp_path / "d.jsonl", rows)
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(str(tmp_path / "dd"))
    data.prepare("dpo", jsonl, tok_dir, tmp_path / "a", max_len=64, eval_fraction=0.1, seed=0)
    data.prepare("dpo", tmp_path / "ds", tok_dir, tmp_path / "b", max_len=64, eval_fraction=0.1, seed=0)
    data.prepare("dpo", tmp_path / "dd", tok_dir, tmp_path / "c", max_len=64, eval_fraction=0.1, seed=0)
    assert _prepared_rows(tmp_path / "a") == _prepared_rows(tmp_path / "b") == _prepared_rows(tmp_path / "c")


def test_saved_hf_dataset_with_messages(tok_dir, tmp_path):
    datasets = pytest.importorskip("datasets")
    messages = [{"role": "user", "content": "1 + 2?"}, {"role": "assistant", "content": "3"}]
    datasets.Dataset.from_list([{"messages": messages}] * 2).save_to_disk(str(tmp_path / "ds"))
    s = data.prepare(
        "sft", tmp_path / "ds", tok_dir, tmp_path / "o", max_len=64, eval_fraction=0.0, seed=0, progress=True
    )
    assert s["rows_kept"] == {"train": 2, "eval": 0}


def test_tokenizer_without_chat_template_is_refused(tmp_path):
    plain = demo.train_tokenizer(DEMO)
    plain.chat_template = None
    plain.save_pretrained(tmp_path / "tok")
    src = _jsonl(tmp_path / "s.jsonl", [{"prompt": "p", "response": "r"}])
    with pytest.raises(ValueError, match="no chat_template") as err:
        data.prepare("sft", src, tmp_path / "tok", tmp_path / "o", max_len=32, eval_fraction=0.1, seed=0)
    assert f"set one as 'chat_template' in {tmp_path / 'tok' / 'tokenizer_config.json'}" in str(err.value)
    assert not (tmp_path / "o").exists()
