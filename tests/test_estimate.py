"""The estimator against DeepSpeed's own formulas, the public stories, the contract and bad input."""

from __future__ import annotations

import dataclasses
import json

import pytest

from memfit import catalog
from memfit.estimate import (
    EstimateError,
    Settings,
    estimate,
    estimate_space,
    fit,
    fit_main,
    main,
    model_states,
    param_layout,
    zero3_subgroups,
)
from memfit.space import Candidate, enumerate_space

GIB = 2**30


def states_on_device(arch, cand, world):
    s = model_states(arch, cand, world, Settings())
    return s.params + s.grads + s.optimizer + s.gathered


# -- DeepSpeed's own model-state formulas, under their assumptions (bf16, full, Adam) ----------


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen2-7b", "qwen2.5-72b"])
@pytest.mark.parametrize("world", [1, 4, 8, 16])
def test_zero2_equals_deepspeed(name, world):
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    arch = catalog.model(name)
    P = param_layout(arch).total
    assert P == arch.num_params()
    cand = Candidate(zero=2, precision="bf16")
    nodes = max(world // 8, 1)
    _, gpu_mem = estimate_zero2_model_states_mem_needs(
        P, num_gpus_per_node=world // nodes, num_nodes=nodes, cpu_offload=False
    )
    assert abs(states_on_device(arch, cand, world) - gpu_mem) <= 16  # integer division only
    off = dataclasses.replace(cand, offload_optimizer="cpu")
    cpu_mem, gpu_mem = estimate_zero2_model_states_mem_needs(
        P,
        num_gpus_per_node=world // nodes,
        num_nodes=nodes,
        cpu_offload=True,
        additional_buffer_factor=1.0,
    )
    s = model_states(arch, off, world, Settings())
    assert s.params + s.grads + s.optimizer == gpu_mem
    if world // nodes * nodes <= 4:  # DeepSpeed's max(4 * N, 16): 16 bytes/param when N <= 4
        assert abs(s.host_optimizer * world // nodes - cpu_mem) <= 64


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen2-7b", "qwen2.5-72b"])
@pytest.mark.parametrize("world", [1, 8, 16])
@pytest.mark.parametrize("offload", ["none", "optimizer", "both"])
def test_zero3_equals_deepspeed(name, world, offload):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    arch = catalog.model(name)
    lay = param_layout(arch)
    nodes = max(world // 8, 1)
    per_node = world // nodes
    cpu_mem, gpu_mem, largest = estimate_zero3_model_states_mem_needs(
        lay.total,
        lay.largest_module,
        num_gpus_per_node=per_node,
        num_nodes=nodes,
        cpu_offload=offload != "none",
        cpu_offload_params=offload == "both",
        zero_init=True,
        additional_buffer_factor=1.0,
    )
    cand = Candidate(
        zero=3,
        precision="bf16",
        offload_optimizer="cpu" if offload != "none" else "none",
        offload_param="cpu" if offload == "both" else "none",
    )
    s = model_states(arch, cand, world, Settings())
    assert s.gathered == largest
    assert abs(s.params + s.grads + s.optimizer + s.gathered - gpu_mem) <= 64
    if offload != "none":
        host = (s.host_optimizer + s.host_params) * per_node
        assert abs(host - cpu_mem) <= 64 * per_node


def test_lora_states_count_only_trainable_params():
    arch = catalog.model("llama-3.1-8b")
    full = model_states(arch, Candidate(zero=2), 8, Settings())
    lora = model_states(arch, Candidate(zero=2, finetune="lora", lora_rank=16), 8, Settings())
    assert lora.optimizer < full.optimizer / 100
    assert lora.params >= full.params  # frozen weights replicated at ZeRO-2, plus adapters


def test_qlora_weights_are_nf4():
    arch = catalog.model("llama-3.1-8b")
    e = estimate(
        arch,
        catalog.gpu("rtx4090"),
        1,
        1,
        "sft",
        Candidate(zero=0, finetune="qlora", seq_len=512, attn="flash"),
    )
    assert not e.invalid
    # 4.127 bits for the decoder linears; embeddings, norms and lm_head stay 16/32-bit
    assert 4.5 * GIB < e.breakdown["params"] < 7.5 * GIB
    assert e.fits
    z3 = estimate(
        arch,
        catalog.gpu("rtx4090"),
        4,
        1,
        "sft",
        Candidate(zero=3, finetune="qlora", seq_len=512, attn="flash"),
    )
    assert z3.breakdown["params"] < e.breakdown["params"] / 3


# -- offload ratio granularity -------------------------------------------------------------------


def test_offload_ratio_rounds_to_subgroups():
    arch = catalog.model("qwen2.5-72b")
    # 72.7B / 8 ranks = 9.1e9 elements per rank: 9 sub-groups of >= 1e9 at the default size
    groups = zero3_subgroups(arch, 8, 1_000_000_000)
    assert len(groups) == 9 and sum(groups) >= param_layout(arch).total // 8
    cand = Candidate(zero=3, offload_optimizer="cpu", offload_ratio=0.3)
    s = model_states(arch, cand, 8, Settings())
    assert s.offload_fraction == pytest.approx(0.3, abs=0.1)
    # a small model has one sub-group per rank: any ratio offloads everything, and we say so
    small = catalog.model("qwen2-7b")
    s = model_states(small, cand, 8, Settings())
    assert s.offload_fraction == 1.0
    assert any("offloads 100%" in n for n in s.notes)


# -- the public stories (DESIGN.md) ------------------------------------------------------------


def test_glm4_dpo_8xa100_fits_with_flash_and_eager_costs_more():
    arch, g = catalog.model("glm-4-9b"), catalog.gpu("a100-80gb")
    cand = Candidate(
        zero=3,
        micro_batch=1,
        seq_len=2048,
        precision="bf16",
        grad_ckpt=True,
        attn="flash",
        ref="model",
    )
    flash = estimate(arch, g, 8, 1, "dpo", cand)
    eager = estimate(arch, g, 8, 1, "dpo", dataclasses.replace(cand, attn="eager"))
    assert flash.fits
    assert eager.device_total_bytes > flash.device_total_bytes
    assert eager.eager_attention_extra_bytes > 0.25 * GIB
    assert any("eager attention" in n for n in eager.notes)
    # variable-length batches fragment the cache; expandable segments recover most of it
    exp = estimate(arch, g, 8, 1, "dpo", cand, settings=Settings(expandable_segments=True))
    assert exp.peak_reserved_bytes < flash.peak_reserved_bytes


def test_qwen2_7b_sft_4x4090_needs_offload_or_lora():
    arch, g = catalog.model("qwen2-7b"), catalog.gpu("rtx4090")
    cand = Candidate(
        zero=3, micro_batch=1, seq_len=128, precision="bf16", grad_ckpt=True, attn="flash"
    )
    plain = estimate(arch, g, 4, 1, "sft", cand)
    assert not plain.fits
    # 16 bytes per parameter over 4 GPUs is ~30 GB of model states alone
    states = plain.phases["optimizer_step"]
    assert states > 24 * 1e9
    for seq in (128, 512, 2048):
        assert not estimate(arch, g, 4, 1, "sft", dataclasses.replace(cand, seq_len=seq)).fits
    off = estimate(
        arch, g, 4, 1, "sft", dataclasses.replace(cand, offload_optimizer="cpu"), host_memory_gb=256
    )
    assert off.fits
    assert off.step_time_s > plain.step_time_s
    starved = estimate(
        arch, g, 4, 1, "sft", dataclasses.replace(cand, offload_optimizer="cpu"), host_memory_gb=64
    )
    assert not starved.fits and starved.host_margin_bytes < 0
    lora = estimate(arch, g, 4, 1, "sft", dataclasses.replace(cand, finetune="lora"))
    assert lora.fits


def test_v100_never_bf16_or_flash():
    arch, g = catalog.model("qwen2-7b"), catalog.gpu("v100-32gb")
    for cand in enumerate_space(
        {"precision": ["bf16", "fp16"], "attn": ["flash", "sdpa", "eager"]},
        {"zero": 3, "seq_len": 1024},
    ):
        e = estimate(arch, g, 8, 1, "dpo", cand)
        assert e.invalid == (cand.precision == "bf16" or cand.attn == "flash"), cand.id
        if e.invalid:
            assert "bf16" in e.reason or "FlashAttention" in e.reason


def test_v100_dpo_4096_vs_2048():
    arch, g = catalog.model("qwen2-7b"), catalog.gpu("v100-32gb")
    cand = Candidate(zero=3, precision="fp16", attn="sdpa", grad_ckpt=True, ref="model")
    long = estimate(arch, g, 8, 1, "dpo", dataclasses.replace(cand, seq_len=4096))
    short = estimate(arch, g, 8, 1, "dpo", dataclasses.replace(cand, seq_len=2048))
    assert (
        long.peak_reserved_bytes - long.peak_allocated_bytes
        > short.peak_reserved_bytes - short.peak_allocated_bytes
    )
    assert long.device_total_bytes > short.device_total_bytes


def test_72b_pinned_host_memory_and_resume():
    arch, g = catalog.model("qwen2.5-72b"), catalog.gpu("a100-80gb")
    base = Candidate(
        zero=3,
        offload_optimizer="cpu",
        offload_param="cpu",
        seq_len=2048,
        attn="flash",
        grad_ckpt=True,
    )
    pinned = estimate(
        arch, g, 8, 1, "sft", dataclasses.replace(base, pin_memory=True), host_memory_gb=1536
    )
    unpinned = estimate(arch, g, 8, 1, "sft", base, host_memory_gb=1536)
    # power-of-two pinned buffers: ~50 GB more per rank in steady state
    assert pinned.host_phases["steady"] > unpinned.host_phases["steady"] + 8 * 40e9
    assert pinned.host_breakdown["pinned_rounding"] > 0
    assert unpinned.host_phases["resume"] > unpinned.host_phases["steady"]


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


def test_fit_longest_sequence(capsys):
    arch, g = catalog.model("llama-3.1-8b"), catalog.gpu("a100-80gb")
    cand = Candidate(zero=3, attn="flash", grad_ckpt=True)
    assert fit(arch, g, 1, 1, "sft", cand, "seq_len")[0] == 0  # 16 bytes/param > 80 GB
    best, e = fit(arch, g, 8, 1, "sft", cand, "seq_len")
    assert best > 1000 and e.fits
    if best < arch.max_position_embeddings:
        assert not estimate(arch, g, 8, 1, "sft", dataclasses.replace(cand, seq_len=best + 1)).fits
    rc = fit_main(
        [
            "--maximize",
            "micro_batch",
            "--model",
            "llama-3.1-8b",
            "--gpu",
            "a100-80gb",
            "--num-gpus",
            "8",
            "--seq-len",
            "4096",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["micro_batch"] >= 1 and out["fits"]


def test_estimate_space_rows():
    arch = catalog.model("qwen2-7b")
    cands = list(enumerate_space({"zero": [2, 3], "grad_ckpt": [True, False]}, {"seq_len": 512}))
    rows = estimate_space(arch, catalog.gpu("a100-80gb"), 8, 1, "sft", cands, 1000)
    assert len(rows) == 4 and all(r["id"] == Candidate.from_dict(r["candidate"]).id for r in rows)
    tiny_rows = estimate_space(
        arch, catalog.gpu("cpu"), 2, 1, "sft", cands[:1], None, budget_bytes=10**9
    )
    assert tiny_rows[0]["device_memory_bytes"] == 10**9 and not tiny_rows[0]["fits"]


def test_monotone_in_seq_len_and_batch():
    arch, g = catalog.model("qwen2.5-7b"), catalog.gpu("h100-80gb")
    prev = 0
    for s in (256, 512, 1024, 4096, 16384):
        e = estimate(arch, g, 8, 1, "dpo", Candidate(zero=3, seq_len=s, attn="flash"))
        assert e.peak_allocated_bytes > prev
        prev = e.peak_allocated_bytes


def test_bad_method_raises():
    with pytest.raises(EstimateError):
        estimate(catalog.model("qwen2-7b"), catalog.gpu("a100-80gb"), 1, 1, "ppo", Candidate())
