"""The per-operation roofline of a GPU step (memfit.estimate.time.roofline): its rates come from a
measurement, each operation takes the longer of its FLOPs and its bytes, and the levers move the
time by the operations they add."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import pytest

from memfit.estimate import Settings, estimate, model_states, step_time
from memfit.estimate.models import catalog
from memfit.estimate.models.params import lora_targets
from memfit.estimate.time import roofline as rl
from memfit.estimate.time import runtime_costs
from memfit.space import Candidate

EVIDENCE = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "gpu_evidence_h100-80gb.json"
ARCH = catalog.model("llama-3.1-8b")


def _compute(cand: Candidate, gpu: str = "h100-80gb", method: str = "sft", settings: Settings | None = None):
    return rl.compute_seconds(ARCH, cand, catalog.gpu(gpu), method, settings or Settings())


def test_rates_are_the_h100_measurement_and_its_fractions_elsewhere():
    """The H100's calibration file holds the median of the measured GEMM shapes; the assumed
    fractions for other GPUs are that measurement over the H100's catalog peak."""
    measured = json.loads(EVIDENCE.read_text())["stages"]["context"]["rows"][0]["measured"]
    gemm = statistics.median(s["tflops"] for s in measured["gemm_shapes"])
    h100 = catalog.gpu("h100-80gb")
    assert rl.H100_GEMM_FRACTION == pytest.approx(gemm / h100.tflops_bf16, rel=1e-6)
    assert rl.H100_ATTENTION_FRACTION == pytest.approx(round(measured["attention_tflops"], 1) / h100.tflops_bf16)
    r = rl.rates(h100, "bf16")
    assert r.gemm == pytest.approx(gemm * 1e12) and "measured 2026-11-26" in r.source
    a100 = rl.rates(catalog.gpu("a100-80gb"), "bf16")
    assert a100.gemm == pytest.approx(rl.H100_GEMM_FRACTION * 312e12)
    assert a100.memory == 2039e9 and "assumed" in a100.source


def test_a_measured_hbm_bandwidth_replaces_the_vendor_figure(tmp_path, monkeypatch):
    from memfit.estimate.models import calibration

    h100 = catalog.gpu("h100-80gb")
    assert rl.rates(h100, "bf16").memory == h100.memory_bandwidth_gbs * 1e9  # the committed file has none
    d = json.loads((calibration.CALIBRATION_DIR / "h100-80gb.json").read_text()) | {"hbm_gbs": 2900.0}
    (tmp_path / "h100-80gb.json").write_text(json.dumps(d))
    monkeypatch.setattr(calibration, "CALIBRATION_DIR", tmp_path)
    r = rl.rates(h100, "bf16")
    assert r.memory == 2900e9 and r.source.endswith("HBM 2,900 GB/s measured")
    slower = _compute(Candidate(seq_len=2048))["memory"]
    monkeypatch.undo()
    assert slower == pytest.approx(_compute(Candidate(seq_len=2048))["memory"] * 3350 / 2900)


def test_a_gemm_is_compute_bound_at_many_rows_and_memory_bound_at_few():
    r = rl.rates(catalog.gpu("h100-80gb"), "bf16")
    big = rl._gemm(8192, 4096, 4096, 2, r)
    assert big == pytest.approx(2 * 8192 * 4096 * 4096 / r.gemm)
    one = rl._gemm(1, 4096, 4096, 2, r)  # reads the whole weight for one row
    assert one == pytest.approx(2 * (4096 + 4096 + 4096 * 4096) / r.memory)
    # per row the small micro batch costs far more
    assert one > 100 * big / 8192


def test_checkpointing_adds_one_forward_of_the_layers_not_of_the_head():
    plain, ckpt = Candidate(seq_len=2048), Candidate(seq_len=2048, grad_ckpt=True)
    a, b = _compute(plain), _compute(ckpt)
    r, d = rl.rates(catalog.gpu("h100-80gb"), "bf16"), 2
    layers_fwd = sum(rl._gemm(2048, i, o, d, r) for _, i, o in lora_targets(ARCH, Settings())) * ARCH.num_layers
    assert b["gemm"] - a["gemm"] == pytest.approx(layers_fwd, rel=1e-9)
    fwd, bwd = rl._attention_seconds(ARCH, plain, 1, d, r)
    assert b["attention"] - a["attention"] == pytest.approx(ARCH.num_layers * fwd) and bwd == 2.5 * fwd
    per_token = rl.elementwise_bytes_per_token(ARCH, d, ARCH.intermediate_size)
    assert b["memory"] - a["memory"] == pytest.approx(2048 * ARCH.num_layers * per_token / r.memory)
    # gradient accumulation repeats the micro step
    assert _compute(dataclasses.replace(ckpt, grad_accum=4))["gemm"] == pytest.approx(4 * b["gemm"])


def test_lora_pays_peft_s_unfused_adapters_in_memory_traffic():
    """peft's LoRA forward per adapted linear and token: dropout, scaling and the add (the skinny
    A and B matmuls are bandwidth-bound GEMMs); backward: the scaling's and the dropout's
    gradients and the input gradient summed over the base and adapter paths. Without dropout the
    input's copy and mask go."""
    lora = Candidate(finetune="lora", lora_rank=16, seq_len=2048)
    drop, nodrop = Settings(lora_alpha_dropout=True), Settings(lora_alpha_dropout=False)
    ins = sum(i for _, i, _ in lora_targets(ARCH, drop))
    outs = sum(o for _, _, o in lora_targets(ARCH, drop))
    assert rl.lora_bytes_per_token(ARCH, lora, drop, 2) == (5 * ins + 10 * outs, 5 * ins + 4 * outs + 6 * ins)
    assert rl.lora_bytes_per_token(ARCH, lora, nodrop, 2) == (10 * outs, 4 * outs + 6 * ins)
    assert rl.lora_bytes_per_token(ARCH, Candidate(), drop, 2) == (0.0, 0.0)
    with_, without = _compute(lora, settings=drop), _compute(lora, settings=nodrop)
    r = rl.rates(catalog.gpu("h100-80gb"), "bf16")
    # the dropout in the forward and its mask multiply in the backward, 32 layers
    assert with_["memory"] - without["memory"] == pytest.approx(2048 * 32 * 5 * ins * 2 / r.memory)
    # A (in -> 16) and B (16 -> out) per adapted linear: forward, input and weight gradients
    adapters = sum(rl._gemm(2048, i, 16, 2, r) + rl._gemm(2048, 16, o, 2, r) for _, i, o in lora_targets(ARCH, drop))
    # bandwidth-bound: the rows in and out are read and written, the rank-16 side is 1% of it
    assert adapters == pytest.approx(2 * 2048 * (ins + outs) / r.memory, rel=0.02)
    full = _compute(Candidate(seq_len=2048))
    assert full["gemm"] > with_["gemm"]  # the weight gradients LoRA does not compute
    assert with_["memory"] > full["memory"]


def test_eager_attention_pays_for_its_score_matrix():
    sdpa, flash = _compute(Candidate(seq_len=4096)), _compute(Candidate(seq_len=4096, attn="flash"))
    eager = _compute(Candidate(seq_len=4096, attn="eager"))
    assert sdpa == flash
    assert eager["attention"] > 2 * sdpa["attention"]
    assert eager["gemm"] == sdpa["gemm"] and eager["memory"] == sdpa["memory"]


def test_the_optimizer_step_reads_and_writes_deepspeed_s_bytes_per_parameter():
    """ZeRO-0's BF16_Optimizer steps every parameter on every rank (60 bytes each in bf16, the clip
    included); ZeRO-2 steps its 1/8 partition (52 bytes); fp32 training converts nothing (40). The
    bytes run at the element-wise share of the bandwidth, and every trainable tensor costs the host
    its loop's time (runtime_costs)."""
    gpu, s = catalog.gpu("a100-80gb"), Settings()
    n, bw = ARCH.num_params(), 2039e9 * runtime_costs.ELEMENTWISE_SHARE
    tensors = ARCH.num_layers * 9 + 3  # 7 linears and 2 norms a layer; embedding, final norm, head
    for cand, world, per_param in (
        (Candidate(zero=0), 8, 60 * n),
        (Candidate(zero=2), 8, 52 * n / 8),
        (Candidate(zero=2, precision="fp32"), 8, 40 * n / 8),
    ):
        t = step_time(ARCH, cand, gpu, "sft", world, 1, model_states(ARCH, cand, world, s), s)
        host = runtime_costs.OPTIMIZER_TENSOR_S * tensors
        assert t["optimizer"] == pytest.approx(per_param / bw + host), cand


def test_estimates_say_where_the_step_time_comes_from():
    gpu = catalog.gpu("a100-80gb")
    est = estimate(ARCH, gpu, 1, 1, "sft", Candidate(finetune="lora", seq_len=2048))
    assert est.time_source.startswith("modelled (each operation at its roofline; GEMM 74% and attention 62%")
    assert est.time_breakdown["compute"] == pytest.approx(
        sum(_compute(Candidate(finetune="lora", seq_len=2048), "a100-80gb").values()), rel=1e-6
    )
    assert sum(est.compute_terms.values()) == pytest.approx(est.time_breakdown["compute"], abs=1e-5)
    cpu = estimate(catalog.model("llama-3.2-1b"), catalog.gpu("cpu"), 1, 1, "sft", Candidate(precision="fp32"))
    assert cpu.time_source.startswith("assumed (40% MFU") and not cpu.compute_terms  # no roofline on the CPU


def test_memfit_estimate_prints_the_compute_by_operation_class(capsys):
    from memfit.estimate.cli import main

    main(["--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--finetune", "lora", "--seq-len", "2048"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("compute by operation class:"))
    assert "gemm" in line and "attention" in line and "memory" in line and line.endswith(" s")


def test_the_formula_count_agrees_with_the_model_s_traced_step(tmp_path):
    """The same Llama-3.1-8B read as a generic card is priced from its traced step (every
    kernel of transformers' own code on fake tensors: matmul and attention FLOPs, every other
    kernel's bytes): the hand-counted roofline of the catalog card agrees with it."""
    from memfit.estimate.models.generic import generic_arch

    generic = generic_arch(ARCH.to_hf_config().to_dict(), "llama-3.1-8b (traced)")
    assert generic.generic and generic.num_params() == ARCH.num_params()
    gpu, s = catalog.gpu("h100-80gb"), Settings(trace_cache=str(tmp_path))
    for cand in (
        Candidate(seq_len=512),
        Candidate(seq_len=512, finetune="lora"),
        Candidate(seq_len=512, attn="eager"),
    ):
        formula = rl.compute_seconds(ARCH, cand, gpu, "sft", s)
        traced = rl.compute_seconds(generic, cand, gpu, "sft", s)
        assert sum(formula.values()) == pytest.approx(sum(traced.values()), rel=0.08), (cand, formula, traced)
        if cand.attn != "eager":  # eager's score traffic is "attention" in the formula, "memory" traced
            assert formula["memory"] == pytest.approx(traced["memory"], rel=0.1), cand
            assert formula["attention"] == pytest.approx(traced["attention"], rel=1e-6), cand
