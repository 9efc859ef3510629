"""`memfit estimate` / `memfit fit` (memfit.estimate.cli): the JSON contract, the table, and
one clear error per bad input."""

from __future__ import annotations

import json

import pytest

from memfit.estimate import fit_main, main
from memfit.units import GIB

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


# -- headroom and units --------------------------------------------------------------------------

BASE = ["--model", "llama-3.1-8b", "--gpu", "a100-80gb", "--num-gpus", "8", "--zero", "3"]


def test_fit_is_the_largest_value_that_fits_with_the_workflow_headroom(capsys):
    """`memfit fit` applies the same 10% headroom as the workflow (memfit.estimate.rows.Budget): the
    value it returns fits with headroom, the next one does not; with --headroom 0 it is larger."""
    sizes = {}
    for headroom in ("0.1", "0"):
        assert (
            fit_main(
                [
                    "--maximize",
                    "micro_batch",
                    *BASE,
                    "--seq-len",
                    "4096",
                    "--headroom",
                    headroom,
                    "--json",
                ]
            )
            == 0
        )
        out = json.loads(capsys.readouterr().out)
        sizes[headroom] = out["micro_batch"]
        assert out["headroom"] == float(headroom) and out["fits_with_headroom"]
        assert (
            out["device_total_bytes"]
            <= out["usable_device_bytes"]
            == int(out["device_memory_bytes"] * (1 - float(headroom)))
        )
        rc = main(
            [
                *BASE,
                "--seq-len",
                "4096",
                "--micro-batch",
                str(out["micro_batch"] + 1),
                "--headroom",
                headroom,
                "--json",
            ]
        )
        above = json.loads(capsys.readouterr().out)
        assert rc == 1 and not above["fits_with_headroom"]
    assert sizes["0.1"] < sizes["0"]


def test_estimate_verdict_uses_headroom(capsys):
    """A configuration between 93% and 100% of the device: fits raw, not with the default headroom
    (the A100 has no calibration file: the uncalibrated margin, 7%)."""
    rc = fit_main(["--maximize", "micro_batch", *BASE, "--seq-len", "4096", "--headroom", "0", "--json"])
    mb = json.loads(capsys.readouterr().out)["micro_batch"]
    rc = main([*BASE, "--seq-len", "4096", "--micro-batch", str(mb)])
    table = capsys.readouterr().out
    if rc == 1:  # the largest raw fit uses more than 90% of the device
        assert "verdict: DOES NOT FIT (device short by" in table and "with 7% headroom (derived" in table
    assert "usable (80.00 GiB less 7% headroom)" in table


def test_host_memory_gib_and_the_decimal_gb_alias_agree(capsys):
    main([*BASE, "--host-memory-gib", "256", "--json"])
    gib_flag = json.loads(capsys.readouterr().out)["host_memory_bytes"]
    main([*BASE, "--host-memory-gb", str(256 * GIB / 1e9), "--json"])
    gb_flag = json.loads(capsys.readouterr().out)["host_memory_bytes"]
    assert abs(gib_flag - 256 * GIB) <= 1 and abs(gb_flag - gib_flag) <= 1


def test_table_breakdown_sums_to_the_figure_under_it_and_names_the_peak(capsys):
    main([*BASE, "--seq-len", "4096"])
    lines = capsys.readouterr().out.splitlines()
    rule = next(i for i, ln in enumerate(lines) if set(ln.strip()) == {"-"})
    start = next(i for i, ln in enumerate(lines) if ln.startswith("per GPU at the peak")) + 1
    parts = [float(ln.split()[-2]) for ln in lines[start:rule]]
    total = float(lines[rule + 1].split()[2])
    assert lines[rule + 1].strip().startswith("device total")
    assert abs(sum(parts) - total) <= 0.01 * len(parts)
    peak = next(ln for ln in lines if ln.startswith("peak set by "))
    assert "other phases:" in peak and "forward" in peak


def test_a_resume_does_not_refuse_what_trains(capsys):
    """GLM-4-9B, full fine-tune, ZeRO-3 on 3 A100-80GB: 55 GiB allocated in training. memfit
    once priced a resume holding m and v twice (75.9 GiB) and refused it; DeepSpeed 0.19.8
    creates the optimizer state lazily, so a resume holds it once (estimate/memory/phases.py `_resume`)."""
    main("--model glm-4-9b --gpu a100-80gb --num-gpus 3 --finetune full --zero 3 --seq-len 2048 --attn sdpa".split())
    table = capsys.readouterr().out
    peak = next(ln for ln in table.splitlines() if ln.startswith("peak set by "))
    assert "(resume)" not in table and not peak.startswith("peak set by resume")
    resume = float(peak.split("resume ")[1].split()[0])
    training = float(peak.split("(")[1].split()[0])
    assert resume < training
    assert "verdict: FITS" in table


def test_cli_trainer_logits_and_nccl_reach_the_estimate(capsys):
    """--logits-handling describes another trainer's loss (torchtune's held fp32 logits: +4 t V
    on the peak); --nccl-mib replaces the NCCL communicator figure of a multi-GPU run."""
    base = ["--model", "llama-3.1-8b", "--gpu", "a100-80gb", "--finetune", "lora", "--zero", "0"]
    base += ["--seq-len", "1024", "--json"]

    def run(*extra):
        assert main(base + list(extra)) == 0
        return json.loads(capsys.readouterr().out)

    own = run()
    held = run("--logits-handling", "torchtune-held")
    assert held["peak_allocated_bytes"] - own["peak_allocated_bytes"] == 4 * 1024 * 128256
    two = run("--num-gpus", "2")
    small = run("--num-gpus", "2", "--nccl-mib", "256")
    assert two["device_total_bytes"] - small["device_total_bytes"] == int(1.79 * 2**30) - 256 * 2**20


@pytest.mark.parametrize(
    ("gpu", "said"),
    [
        ("h100-80gb", "with 5% headroom (derived: memfit's device-total error measured"),
        ("a100-80gb", "with 7% headroom (derived: memfit's uncalibrated device-total error"),
        ("cpu", "with 10% headroom)"),
    ],
)
def test_without_headroom_the_verdict_keeps_the_margin_memfits_measured_error_calls_for(capsys, gpu, said):
    """No --headroom: on a GPU the margin derived from memfit's own device-total error (the
    calibration file's where one exists), named in the verdict; on the cpu the shipped 0.10."""
    budget = ["--budget-gib", "64", "--attn", "sdpa"] if gpu == "cpu" else []
    main(["--model", "qwen2.5-0.5b", "--gpu", gpu, *budget])
    verdict = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("verdict:"))
    assert said in verdict, verdict
    main(["--model", "qwen2.5-0.5b", "--gpu", gpu, *budget, "--headroom", "0.2"])
    out = capsys.readouterr().out
    assert "with 20% headroom" in out and "(derived" not in out  # a given headroom wins, unlabelled


def test_the_cpu_adam_rate_is_a_flag_and_the_step_time_names_it(capsys):
    """Optimizer offload's step is DeepSpeedCPUAdam on the host: its rate per core and the cores
    per rank are flags, said in the step time's source, and a faster rate prices a faster step."""
    argv = ["--model", "qwen2.5-72b", "--gpu", "h100-80gb", "--num-gpus", "8", "--num-nodes", "2"]
    argv += ["--zero", "3", "--offload-optimizer", "cpu", "--json"]
    main(argv)
    default = json.loads(capsys.readouterr().out)
    assert "DeepSpeedCPUAdam at 5.4e+08 params/s per core x 4 cores per rank (default" in default["time_source"]
    main([*argv, "--cpu-adam-rate", "2e9", "--cpu-cores-per-rank", "8"])
    given = json.loads(capsys.readouterr().out)
    assert "DeepSpeedCPUAdam at 2e+09 params/s per core x 8 cores per rank (as given" in given["time_source"]
    assert given["time_breakdown"]["offload"] < default["time_breakdown"]["offload"]
    assert main([*argv, "--cpu-cores-per-rank", "0"]) == 2
    assert "--cpu-cores-per-rank must be > 0, got 0" in capsys.readouterr().err


# -- visible defaults ----------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["estimate", "fit"])
def test_help_shows_every_default(command, capsys):
    from memfit.estimate.cli_parser import parser

    with pytest.raises(SystemExit):
        (main if command == "estimate" else fit_main)(["--help"])
    text = "".join(capsys.readouterr().out.split())  # without the line wrapping
    p = parser(f"memfit {command}", command == "fit")
    for action in p._actions:
        if action.required or action.dest in ("help", "explain") or action.option_strings == ["--no-grad-ckpt"]:
            continue
        words = "".join(action.help.split()).replace("%%", "%")
        assert words in text, action.option_strings
        assert "default" in words or f"{words}(default:{action.default})" in text, action.option_strings


@pytest.mark.parametrize(
    ("extra", "zero"),
    [([], 0), (["--num-gpus", "2"], 3), (["--num-nodes", "2"], 3), (["--offload-optimizer", "cpu"], 3)],
)
def test_zero_defaults_to_0_on_one_gpu_and_3_on_several(extra, zero, capsys):
    main(["--model", "qwen2.5-0.5b", "--gpu", "h100-80gb", *extra, "--json"])
    config = json.loads(capsys.readouterr().out)["configuration"]
    assert config["candidate"]["zero"] == zero and config["defaults_taken"]["--zero"] == zero


def test_json_says_which_configuration_it_priced_and_where_host_ram_came_from(capsys):
    main(["--model", "qwen2.5-7b", "--gpu", "a100-80gb", "--num-gpus", "8", "--method", "dpo", "--json"])
    config = json.loads(capsys.readouterr().out)["configuration"]
    assert config["candidate"] == {
        "zero": 3,
        "offload_optimizer": "none",
        "offload_param": "none",
        "pin_memory": False,
        "offload_ratio": 1.0,
        "grad_ckpt": True,
        "attn": "flash",
        "finetune": "full",
        "lora_rank": 16,
        "micro_batch": 1,
        "seq_len": 2048,
        "grad_accum": 1,
        "precision": "bf16",
        "ref": "model",
        "loss_impl": "full",
        "sequence_parallel": 1,
        "tiled_mlp": False,
        "activation_offload": False,
        "padding_free": False,
        "compile": False,
        "kernels": "none",
    }
    assert config["defaults_taken"]["--ref"] == "model" and config["defaults_taken"]["--seq-len"] == 2048
    assert config["host_memory"] == {
        "bytes": 1024 * 10**9,
        "source": "the catalog's typical a100-80gb node (1024 GB; --host-memory-gib sets yours)",
    }
    main(["--model", "qwen2.5-7b", "--gpu", "a100-80gb", "--host-memory-gib", "512", "--seq-len", "1024", "--json"])
    config = json.loads(capsys.readouterr().out)["configuration"]
    assert (
        config["host_memory"]["source"] == "given (--host-memory-gib)" and "--seq-len" not in config["defaults_taken"]
    )


def test_the_table_states_the_configuration_and_explains_temporaries_and_overheads(capsys):
    main(["--model", "qwen2.5-7b", "--gpu", "a100-80gb", "--method", "dpo", "--finetune", "lora"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("configuration: DPO, LoRA r16 (every linear), ZeRO-0, gradient checkpointing,")
    assert lines[2].startswith("host RAM 953.67 GiB per node: the catalog's typical a100-80gb node")
    assert lines[3].startswith("defaults taken: --zero 0, --grad-ckpt on, --attn flash,")
    legend = next(ln for ln in lines if "temporaries =" in ln)
    assert "overheads = allocator fragmentation" in legend and "CUDA context" in legend
