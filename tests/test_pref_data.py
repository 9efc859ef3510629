"""Data and run configs of rm, ORPO, SimPO and KTO as users meet them: `memfit.data.prepare` for
each method (rm's margin column, KTO's unpaired rows and pairs converted, the KL pairing fixed at
prep time), bad rows refused naming file, line and key, and `memfit launch` refusing bad
hyperparameters before any rank starts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from memfit import cli
from memfit import data as mdata
from memfit.data import DataError, load_split, prepare
from memfit.train import launch as launch_mod
from memfit.train.run_config import DEFAULT_LR, METHODS, RunConfig

REPO = Path(__file__).resolve().parents[1]
PAIRS = [
    {"prompt": "Which is larger, 20 or 43?", "chosen": "43", "rejected": "20"},
    {"prompt": "What number follows 798?", "chosen": "799", "rejected": "797"},
    {"prompt": "Which is smaller, 44 or 15?", "chosen": "15", "rejected": "44"},
    {"prompt": "What number follows 404?", "chosen": "405", "rejected": "406"},
]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("method", ["rm", "orpo", "simpo"])
def test_pair_methods_prepare_the_pairs_dpo_does(demo_model, tmp_path, method):
    src = _jsonl(tmp_path / "pairs.jsonl", PAIRS)
    dpo = prepare("dpo", src, demo_model, tmp_path / "dpo", max_len=32, eval_fraction=0.25)
    got = prepare(method, src, demo_model, tmp_path / method, max_len=32, eval_fraction=0.25)
    assert got["method"] == method and got["rows_kept"] == dpo["rows_kept"] and got["tokens"] == dpo["tokens"]
    assert pq.read_schema(tmp_path / method / "train.parquet").remove_metadata() == mdata.SCHEMAS[method]
    for a, b in zip(load_split(tmp_path / "dpo", "train"), load_split(tmp_path / method, "train"), strict=True):
        assert {k: b[k] for k in a} == a  # the same pairs; rm adds its margin column (null here)
        assert b.get("margin", None) is None


def test_rm_keeps_each_pairs_margin(demo_model, tmp_path):
    src = _jsonl(tmp_path / "m.jsonl", [p | {"margin": i + 0.5} for i, p in enumerate(PAIRS)])
    prepare("rm", src, demo_model, tmp_path / "rm", max_len=32, eval_fraction=0)
    assert [r["margin"] for r in load_split(tmp_path / "rm", "train")] == [0.5, 1.5, 2.5, 3.5]


def test_kto_reads_unpaired_rows_and_converts_pairs(demo_model, tmp_path):
    unpaired = [{"prompt": p["prompt"], "completion": p["chosen"], "label": i % 2 == 0} for i, p in enumerate(PAIRS)]
    unpaired.append(
        {
            "prompt": [{"role": "user", "content": "Hi?"}],
            "completion": [{"role": "assistant", "content": "Hello"}],
            "label": False,
        }
    )
    stats = prepare(
        "kto", _jsonl(tmp_path / "u.jsonl", unpaired), demo_model, tmp_path / "u", max_len=32, eval_fraction=0
    )
    rows = load_split(tmp_path / "u", "train")
    assert [r["label"] for r in rows] == [True, False, True, False, False]
    assert stats["rows_kept"] == {"train": 5, "eval": 0} and set(stats["truncated"]) == {"completion", "kl_completion"}
    # pairs: a desirable (chosen) and an undesirable (rejected) row each, as TRL's unpair_preference_dataset
    prepare("kto", _jsonl(tmp_path / "p.jsonl", PAIRS), demo_model, tmp_path / "p", max_len=32, eval_fraction=0)
    dpo = prepare("dpo", tmp_path / "p.jsonl", demo_model, tmp_path / "dpo", max_len=32, eval_fraction=0)
    rows, pairs = load_split(tmp_path / "p", "train"), load_split(tmp_path / "dpo", "train")
    assert dpo["rows_kept"]["train"] * 2 == len(rows)
    assert [r["label"] for r in rows] == [True, False] * len(pairs)
    for k, pair in enumerate(pairs):
        assert rows[2 * k]["completion_ids"] == pair["chosen_ids"]
        assert rows[2 * k + 1]["completion_ids"] == pair["rejected_ids"]
    # the KL pairing: each row's KL completion is another prompt's completion, fixed in the data
    for i, r in enumerate(rows):
        others = [o["completion_ids"] for o in rows if o["prompt_ids"] != r["prompt_ids"]]
        assert r["kl_completion_ids"] in others, i
        assert r["length"] == len(r["prompt_ids"]) + max(len(r["completion_ids"]), len(r["kl_completion_ids"]))


def test_kto_pairs_the_kl_completions_within_each_split(demo_model, tmp_path):
    src = _jsonl(tmp_path / "pairs.jsonl", [json.loads(line) for line in (REPO / "data/demo/dpo.jsonl").open()][:60])
    prepare("kto", src, demo_model, tmp_path / "k", max_len=32, eval_fraction=0.2)
    for split in ("train", "eval"):
        rows = load_split(tmp_path / "k", split)
        completions = [r["completion_ids"] for r in rows]
        assert rows and all(r["kl_completion_ids"] in completions for r in rows), split


@pytest.mark.parametrize(
    ("method", "rows", "where", "needle"),
    [
        ("kto", [{"prompt": "a", "completion": "b", "label": "yes"}], "line 1, key 'label'", "expected true"),
        ("kto", [{"prompt": "a", "completion": "b", "label": 1}], "line 1, key 'label'", "got 1"),
        ("kto", [{"prompt": "a", "completion": "b"}], "line 1, key 'label'", "KTO rows need"),
        ("kto", [{"prompt": "a", "label": True}], "line 1, key 'completion'", "KTO rows need"),
        ("kto", [{"prompt": "", "completion": "b", "label": True}], "line 1, key 'prompt'", "empty"),
        ("kto", [{"prompt": "a", "completion": 3, "label": True}], "line 1, key 'completion'", "expected a string"),
        ("rm", [PAIRS[0] | {"margin": "big"}], "line 1, key 'margin'", "expected a number, got str"),
        ("rm", [PAIRS[0] | {"margin": True}], "line 1, key 'margin'", "expected a number, got bool"),
        ("rm", [PAIRS[0] | {"margin": 1.0}, PAIRS[1]], "line 2, key 'margin'", "line 1 has a margin and this one"),
        ("orpo", [{"prompt": "a", "chosen": "b"}], "line 1, key 'rejected'", "missing"),
    ],
    ids=["label-str", "label-int", "no-label", "no-completion", "empty-prompt", "completion-int", "margin-str",
         "margin-bool", "margin-mixed", "orpo-no-rejected"],
)  # fmt: skip
def test_bad_rows_are_refused_naming_file_line_and_key(demo_model, tmp_path, method, rows, where, needle):
    src = _jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as e:
        prepare(method, src, demo_model, tmp_path / "out", max_len=32, eval_fraction=0)
    assert f"{src}, {where}" in str(e.value) and needle in str(e.value)
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_every_method_has_a_default_learning_rate():
    assert METHODS == ("sft", "dpo", "rm", "orpo", "simpo", "kto")
    assert all((m, f) in DEFAULT_LR for m in METHODS for f in ("full", "lora", "qlora"))


def _run_json(tmp_path: Path, demo_model, method: str, **kw) -> Path:
    cand = {"zero": 2, "micro_batch": 4, "ref": "model" if method in ("dpo", "kto") else None} | kw.pop("candidate", {})
    d = dataclasses.asdict(
        RunConfig(
            method=method,
            model_path=str(demo_model),
            data_dir=str(tmp_path),
            out_dir=str(tmp_path / "o"),
            candidate=cand,
        )
    )
    path = tmp_path / "run.json"
    path.write_text(json.dumps(d | kw))
    return path


@pytest.mark.parametrize(
    ("method", "change", "needle"),
    [
        ("simpo", {"pref": {"gamma": 0.5}}, "train.simpo: simpo: unknown hyperparameter 'gamma' (known: beta, simpo_gamma"),
        ("kto", {"pref": {"beta": -1}}, "train.kto: kto beta must be > 0, got -1"),
        ("rm", {"pref": {"center_rewards_coefficient": -0.1}}, "rm center_rewards_coefficient must be >= 0"),
        ("kto", {"candidate": {"zero": 2, "micro_batch": 1, "ref": "model"}}, "kto needs a micro batch of 2 or more"),
        ("kto", {"candidate": {"zero": 2, "micro_batch": 4, "ref": None}}, "kto needs a reference mode (search.ref"),
        ("dpo", {"pref": {"beta": 0.1}}, "train.dpo: hyperparameters ['beta'] apply to rm, orpo, simpo, kto"),
    ],
    ids=["unknown-key", "kto-beta", "rm-center", "kto-micro-1", "kto-no-ref", "pref-on-dpo"],
)  # fmt: skip
def test_launch_refuses_bad_preference_settings_before_any_rank(
    tmp_path, demo_model, capsys, monkeypatch, method, change, needle
):
    path = _run_json(tmp_path, demo_model, method)
    d = json.loads(path.read_text()) | change
    path.write_text(json.dumps(d))
    started = []
    monkeypatch.setattr(launch_mod, "launch", lambda *a, **k: started.append(a) or 0)
    rc = cli.main(["launch", "--config", str(path), "--nproc", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and started == []
    assert needle in err and str(path) in err, err
    assert "Traceback" not in err and err.count("\n") == 1, err


def test_launch_refuses_data_prepared_for_another_kind_of_row(tmp_path, demo_model, capsys, monkeypatch):
    prepare("orpo", _jsonl(tmp_path / "pairs.jsonl", PAIRS), demo_model, tmp_path / "orpo", max_len=32)
    path = _run_json(tmp_path, demo_model, "orpo")
    path.write_text(json.dumps(json.loads(path.read_text()) | {"method": "kto", "data_dir": str(tmp_path / "orpo")}))
    started = []
    monkeypatch.setattr(launch_mod, "launch", lambda *a, **k: started.append(a) or 0)
    rc = cli.main(["launch", "--config", str(path), "--nproc", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and started == []
    assert f"data_dir {tmp_path / 'orpo'} was prepared for orpo (its stats.json), whose rows kto cannot" in err
    assert "Traceback" not in err and err.count("\n") == 1, err
    # pairs prepared for one pair method train the others: simpo on orpo's data is accepted
    path.write_text(json.dumps(json.loads(path.read_text()) | {"method": "simpo"}))
    assert cli.main(["launch", "--config", str(path), "--nproc", "2"]) == 0 and len(started) == 1
