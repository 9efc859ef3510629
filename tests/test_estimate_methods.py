"""`memfit estimate --method` for the six methods (issue #44): what each holds compared with SFT
and DPO as a user reads it from the JSON, and the flags a method does not take refused with one
clear line naming it."""

from __future__ import annotations

import json

import pytest

from memfit.estimate import main

BASE = [
    "--model",
    "llama-3.1-8b",
    "--gpu",
    "a100-80gb",
    "--num-gpus",
    "8",
    "--seq-len",
    "2048",
    "--micro-batch",
    "2",
    "--json",
]


def _estimate(capsys, method: str, *extra: str) -> dict:
    assert main([*BASE, "--method", method, *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_each_method_holds_what_it_runs(capsys, finetune):
    """A reward model holds no vocabulary logits and no V x h head; ORPO and SimPO hold DPO's pair
    without its reference; KTO one row with gradient (less than DPO's pair) plus its reference."""
    flags = ["--finetune", finetune, "--zero", "3" if finetune == "full" else "0"]
    out = {m: _estimate(capsys, m, *flags) for m in ("sft", "dpo", "rm", "orpo", "simpo", "kto")}
    V, h = 128256, 4096  # llama-3.1-8b's vocabulary and width
    assert out["rm"]["breakdown"]["logits"] == 0 and out["orpo"]["breakdown"]["logits"] > 0
    assert out["sft"]["params_total"] - out["rm"]["params_total"] == V * h - h  # the head is an h x 1 score
    same = {k: v for k, v in out["orpo"].items() if k != "configuration"}
    assert same == {k: v for k, v in out["simpo"].items() if k != "configuration"}  # the same step, another loss
    assert out["rm"]["configuration"]["method"] == "rm"
    assert out["orpo"]["breakdown"]["reference"] == 0 and out["dpo"]["breakdown"]["reference"] >= 0
    assert out["orpo"]["peak_allocated_bytes"] <= out["dpo"]["peak_allocated_bytes"]
    assert out["kto"]["peak_allocated_bytes"] < out["dpo"]["peak_allocated_bytes"]
    assert out["kto"]["peak_allocated_bytes"] >= out["sft"]["peak_allocated_bytes"]
    # KTO's KL batch and reference forwards cost time, not tokens: its step is slower than SFT's
    # at the same tokens per step
    assert out["kto"]["step_time_s"] > out["sft"]["step_time_s"]
    assert out["orpo"]["tokens_per_s"] > 0 and out["rm"]["step_time_s"] < out["orpo"]["step_time_s"]


def test_kto_with_a_frozen_reference_holds_a_second_copy_of_the_weights(capsys):
    model = _estimate(capsys, "kto", "--finetune", "full", "--zero", "3", "--ref", "model")
    pre = _estimate(capsys, "kto", "--finetune", "full", "--zero", "3", "--ref", "precomputed")
    assert model["breakdown"]["reference"] > 0 and pre["breakdown"]["reference"] == 0


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--method", "rm", "--ref", "model"], "--ref does nothing with --method rm"),
        (["--method", "orpo", "--ref", "adapter", "--finetune", "lora"], "--ref does nothing with --method orpo"),
        (["--method", "simpo", "--ref", "precomputed"], "--method simpo"),
        (["--method", "sft", "--ref", "model"], "--method sft"),
        (["--method", "rm", "--loss-impl", "chunked"], "--loss-impl chunked does nothing with --method rm"),
        (["--method", "kto", "--sequence-parallel", "2"], "--sequence-parallel above 1 with --method kto"),
        (["--method", "kto", "--micro-batch", "1"], "--micro-batch below 2 with --method kto"),
        (["--method", "ppo"], "--method"),
    ],
)
def test_a_flag_the_method_does_not_take_is_one_clear_error(argv, words, capsys):
    if "ppo" in argv:  # argparse's own refusal of an unknown choice: exit 2, the choices named
        with pytest.raises(SystemExit) as exc:
            main([*BASE, *argv])
        rc = exc.value.code
    else:
        rc = main([*BASE, *argv])
    captured = capsys.readouterr()
    assert rc == 2 and words in captured.err and "Traceback" not in captured.err
    assert captured.out == ""
    if "ppo" in argv:
        assert "rm" in captured.err and "kto" in captured.err
    else:
        assert captured.err.count("\n") == 1


def test_the_api_refuses_an_unknown_method_naming_the_six():
    from memfit.estimate import EstimateError, estimate
    from memfit.estimate.models import catalog
    from memfit.space import Candidate

    with pytest.raises(EstimateError, match="method must be one of sft, dpo, rm, orpo, simpo, kto, got 'ppo'"):
        estimate(catalog.model("llama-3.1-8b"), catalog.gpu("a100-80gb"), 1, 1, "ppo", Candidate())


def test_kto_prices_two_rows_a_micro_batch_when_none_is_given(capsys):
    """KTO's KL batch needs two rows (the trainer refuses one): the default micro batch is 2, and
    `memfit fit --maximize micro_batch` searches from 2."""
    from memfit.estimate.cli_fit import fit_main

    base = [a for a in BASE if a not in ("--micro-batch", "2")]
    assert main([*base, "--method", "kto"]) == 0
    assert json.loads(capsys.readouterr().out)["configuration"]["candidate"]["micro_batch"] == 2
    assert fit_main([*base[:-1], "--method", "kto", "--finetune", "lora", "--maximize", "micro_batch"]) == 0
    assert "micro_batch 1:" not in capsys.readouterr().err
