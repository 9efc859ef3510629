"""The estimator (memfit.estimate.core): the public stories, fit, estimate_space and bad input.
Model states: test_estimate_states.py; the CLI: test_estimate_cli.py; exact outputs:
test_estimate_golden.py."""

from __future__ import annotations

import dataclasses
import json

import pytest

from memfit.estimate import EstimateError, Settings, estimate, estimate_space, fit, fit_main
from memfit.estimate.models import catalog
from memfit.space import Candidate, enumerate_space
from memfit.units import GIB

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
    cand = Candidate(zero=3, micro_batch=1, seq_len=128, precision="bf16", grad_ckpt=True, attn="flash")
    plain = estimate(arch, g, 4, 1, "sft", cand)
    assert not plain.fits
    # 16 bytes per parameter over 4 GPUs is ~30 GB of model states alone
    states = plain.phases["optimizer_step"]
    assert states > 24 * 1e9
    for seq in (128, 512, 2048):
        assert not estimate(arch, g, 4, 1, "sft", dataclasses.replace(cand, seq_len=seq)).fits
    off = estimate(arch, g, 4, 1, "sft", dataclasses.replace(cand, offload_optimizer="cpu"), host_memory_gb=256)
    assert off.fits
    assert off.step_time_s > plain.step_time_s
    starved = estimate(arch, g, 4, 1, "sft", dataclasses.replace(cand, offload_optimizer="cpu"), host_memory_gb=64)
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
    assert long.peak_reserved_bytes - long.peak_allocated_bytes > short.peak_reserved_bytes - short.peak_allocated_bytes
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
    pinned = estimate(arch, g, 8, 1, "sft", dataclasses.replace(base, pin_memory=True), host_memory_gb=1536)
    unpinned = estimate(arch, g, 8, 1, "sft", base, host_memory_gb=1536)
    # power-of-two pinned buffers: ~50 GB more per rank in steady state
    assert pinned.host_phases["steady"] > unpinned.host_phases["steady"] + 8 * 40e9
    assert pinned.host_breakdown["pinned_rounding"] > 0
    # the design's story: unpinned, the node then ran out of RAM at resume (DeepSpeed's load reads
    # every rank's optimizer shard whole); memfit's trainer streams the files, so no resume needs
    # more host RAM than the training's own phases on that 1.4 TB node
    training = max(v for k, v in unpinned.host_phases.items() if k != "resume")
    assert unpinned.host_phases["resume"] <= training and unpinned.fits
    deepspeed_load = estimate(
        arch, g, 8, 1, "sft", base, host_memory_gb=1536, settings=Settings(trainer_loader="deepspeed")
    )
    assert deepspeed_load.host_phases["resume"] > 1536e9 and not deepspeed_load.fits


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
    tiny_rows = estimate_space(arch, catalog.gpu("cpu"), 2, 1, "sft", cands[:1], None, budget_bytes=10**9)
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
