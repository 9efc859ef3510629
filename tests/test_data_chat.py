"""memfit.data with chat rows as users have them: `messages` and ShareGPT `conversations` with loss
on every assistant turn (data.assistant_loss) or the last, TRL's conversational preference pairs
(explicit or implicit prompt), and the bad rows each format can have."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from memfit import data
from memfit.workflow import demo

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "data" / "demo"

SYSTEM = {"role": "system", "content": "Be brief."}
CHAT = [  # three user/assistant exchanges
    SYSTEM,
    {"role": "user", "content": "1 + 1?"},
    {"role": "assistant", "content": "2"},
    {"role": "user", "content": "and 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "and 3 + 3?"},
    {"role": "assistant", "content": "6"},
]
SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _prepare(method, rows, tok_dir, out: Path, **kw) -> list[dict]:
    src = _jsonl(out.parent / f"{out.name}.jsonl", rows)
    data.prepare(method, src, tok_dir, out, **({"max_len": 64, "eval_fraction": 0.0, "seed": 0} | kw))
    return data.load_split(out, "train") + data.load_split(out, "eval")


def _sharegpt(messages: list[dict]) -> list[dict]:
    return [{"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]} for m in messages]


# ------------------------------------------------------------------------------- SFT


def test_three_turn_chat_scores_every_assistant_turn_token_by_token(tok_dir, tok, tmp_path):
    (row,) = _prepare("sft", [{"messages": CHAT}], tok_dir, tmp_path / "o")
    ids, labels = row["input_ids"], row["labels"]
    # the row is the whole conversation as the template renders it
    assert ids == tok(tok.apply_chat_template(CHAT, tokenize=False), add_special_tokens=False)["input_ids"]
    # the demo template renders an assistant turn as <|assistant|>{content}<|eos|>: a token is
    # scored exactly when it lies after an <|assistant|> marker, up to and including its <|eos|>
    scored, inside = [], False
    for t in tok.convert_ids_to_tokens(ids):
        if t == "<|assistant|>":
            scored.append(False)
            inside = True
            continue
        scored.append(inside)
        if t == tok.eos_token:
            inside = False
    assert len(labels) == len(ids) == row["length"]
    for i, (x, y, s) in enumerate(zip(ids, labels, scored, strict=True)):
        assert y == (x if s else data.IGNORE_INDEX), f"token {i} {tok.convert_ids_to_tokens(x)!r}"
    spans, cur = [], []
    for x, y in zip(ids, labels, strict=True):
        if y != data.IGNORE_INDEX:
            cur.append(x)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    spans.append(tok.decode(cur))
    assert spans == ["2<|eos|>", "4<|eos|>", "6<|eos|>"]
    stats = json.loads((tmp_path / "o" / "stats.json").read_text())
    assert (stats["assistant_loss"], stats["loss_tokens"]) == ("all", sum(s for s in scored))


def test_assistant_loss_last_scores_only_the_final_turn_of_the_same_tokens(tok_dir, tok, tmp_path):
    (every,) = _prepare("sft", [{"messages": CHAT}], tok_dir, tmp_path / "a")
    (last,) = _prepare("sft", [{"messages": CHAT}], tok_dir, tmp_path / "b", assistant_loss="last")
    assert last["input_ids"] == every["input_ids"]
    k = len(tok(tok.apply_chat_template(CHAT[:-1], tokenize=False, add_generation_prompt=True))["input_ids"])
    assert last["labels"] == [data.IGNORE_INDEX] * k + last["input_ids"][k:]
    assert tok.decode(last["input_ids"][k:]) == "6<|eos|>"


@pytest.mark.parametrize(
    "shape",
    ["sharegpt human/gpt", "sharegpt user/assistant", "conversations of role/content"],
)
def test_sharegpt_conversations_prepare_as_the_same_messages(shape, tok_dir, tmp_path):
    if shape == "sharegpt human/gpt":
        conv = _sharegpt(CHAT)
    elif shape == "sharegpt user/assistant":
        conv = [{"from": m["role"], "value": m["content"]} for m in CHAT]
    else:
        conv = CHAT
    expected = _prepare("sft", [{"messages": CHAT}], tok_dir, tmp_path / "m")
    assert _prepare("sft", [{"conversations": conv}], tok_dir, tmp_path / "c") == expected


def test_parquet_rows_mixing_shapes_read_each_row_by_its_own(tok_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"conversations": _sharegpt(CHAT)}, {"messages": CHAT}, {"prompt": "7 + 1?", "response": "8"}]
    keys = ("conversations", "messages", "prompt", "response")  # each row: the others' columns null
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), tmp_path / "mixed.parquet")
    data.prepare("sft", tmp_path / "mixed.parquet", tok_dir, tmp_path / "p", max_len=64, eval_fraction=0.0)
    assert data.load_split(tmp_path / "p", "train") == _prepare("sft", rows, tok_dir, tmp_path / "j")


def test_prompt_response_rows_equal_two_turn_messages(tok_dir, tmp_path):
    pair = [{"role": "user", "content": "7 + 1?"}, {"role": "assistant", "content": "8"}]
    a = _prepare("sft", [{"prompt": "7 + 1?", "response": "8"}], tok_dir, tmp_path / "a")
    b = _prepare("sft", [{"messages": pair}], tok_dir, tmp_path / "b")
    assert a == b


def test_chat_rows_truncation_and_drops_are_counted(tok_dir, tok, tmp_path):
    long_answer = {**CHAT[-1], "content": " ".join(["6"] * 40)}
    prefix = len(tok(tok.apply_chat_template(CHAT[:-1], tokenize=False, add_generation_prompt=True))["input_ids"])
    rows = [
        {"messages": CHAT[:-1] + [long_answer]},
        {"messages": CHAT},
        {"messages": CHAT[:-1] + [{**CHAT[-1], "content": " "}]},
    ]
    max_len = prefix + 3  # room for the final "6<|eos|>" and little more
    kept = _prepare("sft", rows, tok_dir, tmp_path / "o", max_len=max_len)
    s = json.loads((tmp_path / "o" / "stats.json").read_text())
    assert s["truncated"] == {"response": 1}
    assert s["dropped"] == {"blank_line": 0, "empty_response": 1, "prompt_too_long": 0}
    assert [r["row"] for r in kept] == [1, 2] and all(r["length"] <= max_len for r in kept)
    # the earlier assistant turns are part of what is never cut: below it the row is dropped
    _prepare("sft", rows[1:2], tok_dir, tmp_path / "p", max_len=prefix + 3)
    with pytest.raises(data.DataError, match="prompt_too_long: 1"):
        _prepare("sft", rows[1:2], tok_dir, tmp_path / "q", max_len=prefix)


def _tokenizer_with(tok_dir: Path, template: str, path: Path) -> Path:
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok_dir)
    t.chat_template = template
    t.save_pretrained(path)
    return path


def test_template_that_rewrites_earlier_turns_needs_assistant_loss_last(tok_dir, tmp_path):
    # like templates that drop past reasoning: an earlier assistant turn renders as "..."
    forgetful = demo.CHAT_TEMPLATE.replace(
        "<|assistant|>{{ message['content'] }}",
        "<|assistant|>{% if loop.last %}{{ message['content'] }}{% else %}...{% endif %}",
    )
    path = _tokenizer_with(tok_dir, forgetful, tmp_path / "tok")
    with pytest.raises(data.DataError, match=r"line 1, key 'messages\[2\]'.*set data.assistant_loss: last"):
        _prepare("sft", [{"messages": CHAT}], path, tmp_path / "o")
    assert not (tmp_path / "o").exists()
    (row,) = _prepare("sft", [{"messages": CHAT}], path, tmp_path / "o", assistant_loss="last")
    assert row["labels"].count(data.IGNORE_INDEX) < len(row["labels"])


def test_a_template_refusing_a_conversation_names_the_row(tok_dir, tmp_path):
    strict = (
        "{% for message in messages %}{% if message['role'] == 'user' and loop.previtem is defined "
        "and loop.previtem['role'] == 'user' %}{{ raise_exception('roles must alternate') }}{% endif %}"
        "{% endfor %}" + demo.CHAT_TEMPLATE
    )
    path = _tokenizer_with(tok_dir, strict, tmp_path / "tok")
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]
    good = {"messages": CHAT[1:3]}
    with pytest.raises(
        data.DataError, match=r"line 2, key 'messages'.*refused this conversation \(roles must alternate\)"
    ):
        _prepare("sft", [good, {"messages": twice}], path, tmp_path / "o")


# ------------------------------------------------------------------------------- DPO

PAIRS = [("1 + 1?", "2", "3"), ("2 + 5?", "7", "6"), ("9 - 4?", "5", "4")]


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


DPO_SHAPES = {
    "explicit prompt": lambda p, c, r: {"prompt": [_user(p)], "chosen": [_assistant(c)], "rejected": [_assistant(r)]},
    "implicit prompt": lambda p, c, r: {"chosen": [_user(p), _assistant(c)], "rejected": [_user(p), _assistant(r)]},
    "string prompt, message answers": lambda p, c, r: {
        "prompt": p,
        "chosen": [_assistant(c)],
        "rejected": [_assistant(r)],
    },
    "ultrafeedback (string prompt, full conversations)": lambda p, c, r: {
        "prompt": p,
        "chosen": [_user(p), _assistant(c)],
        "rejected": [_user(p), _assistant(r)],
    },
    "explicit prompt, full conversations": lambda p, c, r: {
        "prompt": [_user(p)],
        "chosen": [_user(p), _assistant(c)],
        "rejected": [_user(p), _assistant(r)],
    },
    "llama-factory ranking": lambda p, c, r: {
        "conversations": [{"from": "human", "value": p}],
        "chosen": {"from": "gpt", "value": c},
        "rejected": {"from": "gpt", "value": r},
    },
}


@pytest.mark.parametrize("shape", list(DPO_SHAPES))
def test_conversational_pairs_prepare_as_the_string_pairs(shape, tok_dir, tmp_path):
    strings = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS]
    expected = _prepare("dpo", strings, tok_dir, tmp_path / "s")
    assert _prepare("dpo", [DPO_SHAPES[shape](*t) for t in PAIRS], tok_dir, tmp_path / "c") == expected


def test_parquet_pairs_mixing_explicit_and_implicit_prompts(tok_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    shapes = ("explicit prompt", "implicit prompt", "explicit prompt")
    rows = [DPO_SHAPES[shape](*t) for shape, t in zip(shapes, PAIRS, strict=True)]
    full = [{k: r.get(k) for k in ("prompt", "chosen", "rejected")} for r in rows]  # implicit: prompt null
    pq.write_table(pa.Table.from_pylist(full), tmp_path / "pairs.parquet")
    data.prepare("dpo", tmp_path / "pairs.parquet", tok_dir, tmp_path / "p", max_len=64, eval_fraction=0.0)
    strings = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS]
    assert data.load_split(tmp_path / "p", "train") == _prepare("dpo", strings, tok_dir, tmp_path / "s")


def test_implicit_multi_turn_pair_takes_the_shared_prefix_as_prompt(tok_dir, tok, tmp_path):
    history = [SYSTEM, _user("1 + 1?"), _assistant("2"), _user("and 2 + 2?")]
    row = {"chosen": history + [_assistant("4")], "rejected": history + [_assistant("5")]}
    (out,) = _prepare("dpo", [row], tok_dir, tmp_path / "o")
    text = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert out["prompt_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert (tok.decode(out["chosen_ids"]), tok.decode(out["rejected_ids"])) == ("4<|eos|>", "5<|eos|>")


def test_identical_conversational_pair_is_dropped_as_a_string_pair_is(tok_dir, tmp_path):
    rows = [DPO_SHAPES["implicit prompt"](*PAIRS[0]), DPO_SHAPES["implicit prompt"]("3 + 3?", "6", "6")]
    _prepare("dpo", rows, tok_dir, tmp_path / "o")
    s = json.loads((tmp_path / "o" / "stats.json").read_text())
    assert s["dropped"]["identical_chosen_rejected"] == 1 and sum(s["rows_kept"].values()) == 1


# -------------------------------------------------------------------------- bad rows

GOOD_SFT = {"messages": CHAT[1:3]}
GOOD_DPO = DPO_SHAPES["implicit prompt"](*PAIRS[0])
BAD_ROWS = {
    # name: (method, rows, line, key, words the message must contain)
    "wrong role (messages)": (
        "sft",
        [GOOD_SFT, {"messages": [{"role": "bot", "content": "hi"}, _assistant("2")]}],
        2,
        "messages[0].role",
        "unknown role 'bot'; roles are system, user, human, assistant, gpt",
    ),
    "wrong role (ShareGPT)": (
        "sft",
        [{"conversations": [{"from": "human", "value": "1?"}, {"from": "function_call", "value": "f()"}]}],
        1,
        "conversations[1].from",
        "unknown role 'function_call'",
    ),
    "empty conversation": (
        "sft",
        [GOOD_SFT, GOOD_SFT, {"conversations": []}],
        3,
        "conversations",
        "an empty conversation",
    ),
    "no assistant turn": (
        "sft",
        [{"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "1?"}]}],
        1,
        "conversations",
        "no assistant turn",
    ),
    "ShareGPT turn missing value": (
        "sft",
        [{"conversations": [{"from": "human"}, {"from": "gpt", "value": "2"}]}],
        1,
        "conversations[0].value",
        "missing (a turn needs 'role' and 'content', or ShareGPT's 'from' and 'value'",
    ),
    "pair of different prompts": (
        "dpo",
        [GOOD_DPO, {"chosen": [_user("1 + 1?"), _assistant("2")], "rejected": [_user("1 + 2?"), _assistant("3")]}],
        2,
        "chosen[0]",
        "chosen and rejected differ at turn 0, a 'user' turn: they answer different prompts",
    ),
    "explicit prompt, answer to another prompt": (
        "dpo",
        [{"prompt": [_user("1 + 1?")], "chosen": [_user("1 + 2?"), _assistant("3")], "rejected": [_assistant("3")]}],
        1,
        "chosen",
        "expected one assistant turn answering the prompt, got turns ['user', 'assistant']",
    ),
    "empty chosen conversation": (
        "dpo",
        [{"prompt": [_user("1?")], "chosen": [], "rejected": [_assistant("3")]}],
        1,
        "chosen",
        "an empty conversation",
    ),
    "rejected a string beside a chosen list": (
        "dpo",
        [{"prompt": "1?", "chosen": [_assistant("2")], "rejected": "3"}],
        1,
        "rejected",
        "expected a list of turns, as 'chosen' is, got str",
    ),
    "prompt a list, answers strings": (
        "dpo",
        [{"prompt": [_user("1?")], "chosen": "2", "rejected": "3"}],
        1,
        "chosen",
        "expected a list of turns, as 'prompt' is, got str",
    ),
    "pair with no shared prompt": (
        "dpo",
        [{"chosen": [_assistant("2")], "rejected": [_assistant("3")]}],
        1,
        "chosen",
        "no prompt",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_bad_chat_rows_name_file_line_key_and_leave_no_output(case, tok_dir, tmp_path):
    method, rows, line, key, words = BAD_ROWS[case]
    src = _jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(data.DataError) as err:
        data.prepare(method, src, tok_dir, tmp_path / "out", max_len=64, eval_fraction=0.0, seed=0)
    message = str(err.value)
    assert message.startswith(f"{src}, line {line}, key {key!r}: ") and words in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


# -------------------------------------------------------------------------- workflow


def test_workflow_config_refuses_a_bad_assistant_loss_naming_the_key(tmp_path, capsys):
    from memfit import cli

    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    config["data"]["assistant_loss"] = "every"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    assert cli.main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "data.assistant_loss: 'every' is not allowed (allowed: 'all', 'last')" in err, err
    assert "Traceback" not in err


# ------------------------------------------------------------------- trained from chat data


@pytest.mark.slow
def test_the_demo_chats_train_sft_on_two_ranks(demo_model, tmp_path):
    """The shipped 3-exchange chats (data/demo/chat_sft.jsonl), loss on every answer, through
    memfit's DeepSpeed trainer (2 CPU ranks): the loss falls."""
    from deepspeed_runs import base_run, run

    stats = data.prepare("sft", DEMO / "chat_sft.jsonl", demo_model, tmp_path / "data/sft", max_len=96)
    assert stats["dropped"]["prompt_too_long"] == 0 and sum(stats["rows_kept"].values()) == 320
    cfg = base_run(demo_model, tmp_path / "data", tmp_path / "sft", zero=0, seq_len=96, micro_batch=4)
    rows = run(dataclasses.replace(cfg, max_steps=4, save_every=4, eval_every=4))
    losses = [r["loss"] for r in rows if r["split"] == "train"]
    assert len(losses) == 4 and losses[-1] < losses[0]


@pytest.mark.slow
def test_the_demo_conversational_pairs_train_dpo_on_two_ranks(demo_model, tmp_path):
    """The shipped multi-turn pairs (data/demo/chat_dpo.jsonl, TRL's explicit-prompt format) through
    memfit's DeepSpeed DPO (2 CPU ranks, precomputed reference): the first loss is log 2."""
    from deepspeed_runs import base_run, run

    stats = data.prepare("dpo", DEMO / "chat_dpo.jsonl", demo_model, tmp_path / "data/dpo", max_len=96)
    assert sum(stats["rows_kept"].values()) == 192
    cfg = base_run(demo_model, tmp_path / "data", tmp_path / "dpo", method="dpo", zero=0, ref="precomputed", seq_len=96)
    rows = run(dataclasses.replace(cfg, max_steps=1, save_every=1, eval_every=1))
    first = next(r for r in rows if r["split"] == "train")
    assert first["loss"] == pytest.approx(0.6931, abs=1e-3)  # the policy starts as its reference: log 2
