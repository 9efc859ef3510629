"""Step time from a machine's calibration (memfit.estimate.time.timing) and how the estimator uses it."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from memfit.estimate import Settings, estimate
from memfit.estimate.models import catalog
from memfit.estimate.time import timing
from memfit.space import Candidate, compute_engine, compute_key, engine_key, enumerate_space
from memfit.train.calibrate import plan

CAND = Candidate(zero=3, grad_ckpt=True, micro_batch=4, grad_accum=4, seq_len=24, precision="fp32", attn="sdpa")


LLAMA = catalog.model("llama-2-7b")
A100 = {"device_name": "NVIDIA A100-SXM4-80GB", "device_total_bytes": 81920 * 2**20, "backend": "nccl"}
H100 = {"device_name": "NVIDIA H100 80GB HBM3", "device_total_bytes": 81559 * 2**20, "backend": "nccl"}


def _write(tmp_path, compute, runtime, arch=LLAMA, **meta):
    """A calibration file as memfit.train.calibrate writes it: of `arch` on 2 CPU ranks unless `meta` says otherwise."""
    d = {"format": timing.FORMAT, "measured_on": "2026-11-26T07:00:00+00:00", "device": "cpu (x86_64)", "world_size": 2}
    d |= {"device_name": "cpu", "device_total_bytes": 16 * 2**30, "model": timing.model_identity(arch)}
    d |= {"threads_per_rank": 1, "backend": "gloo", "layers": [1, 4], **meta, "compute": compute, "runtime": runtime}
    p = tmp_path / "calibration.json"
    p.write_text(json.dumps(d))
    return p


def test_terms_are_affine_in_layers_and_accumulation_repeats_the_micro_step(tmp_path):
    # 1 layer: compute 10 ms; 4 layers: 40 ms -> 10 ms a layer, 0 elsewhere; an 8-layer model: 80 ms
    p = _write(
        tmp_path,
        {compute_key("sft", CAND): {"1": 0.010, "4": 0.040}},
        {engine_key(CAND): {"micro": {"1": 0.005, "4": 0.020}, "boundary": {"1": 0.030, "4": 0.060}}},
    )
    b = timing.predict(timing.load(p), CAND, "sft", num_layers=8)
    assert b["compute"] == pytest.approx(4 * 0.080)  # grad_accum 4 micro steps
    assert b["deepspeed"] == pytest.approx(4 * 0.040)
    assert b["boundary"] == pytest.approx(0.030 + 7 * 0.010)  # once per optimizer step
    assert b["reference"] == 0.0  # SFT has none


def test_a_runtime_cost_measured_below_zero_is_priced_as_none(tmp_path):
    p = _write(
        tmp_path,
        {compute_key("sft", CAND): {"1": 0.010, "4": 0.040}},
        {engine_key(CAND): {"micro": {"1": -0.002, "4": -0.001}, "boundary": {"1": 0.01, "4": -0.05}}},
    )
    b = timing.predict(timing.load(p), CAND, "sft", num_layers=4)
    assert b["deepspeed"] == 0.0 and b["boundary"] == 0.0


def test_the_zero3_reference_counts_only_for_dpo_with_a_reference_model(tmp_path):
    ref_model = dataclasses.replace(CAND, ref="model")
    pre = dataclasses.replace(CAND, ref="precomputed")
    rt = {"micro": {"1": 0.0, "4": 0.0}, "boundary": {"1": 0.0, "4": 0.0}, "ref": {"1": 0.01, "4": 0.01}}
    compute = {compute_key("dpo", c): {"1": 0.01, "4": 0.01} for c in (ref_model, pre)}
    cal = timing.load(_write(tmp_path, compute, {engine_key(CAND): rt}))
    assert timing.predict(cal, ref_model, "dpo", 4)["reference"] == pytest.approx(4 * 0.01)
    assert timing.predict(cal, pre, "dpo", 4)["reference"] == 0.0


def test_a_missing_measurement_is_named(tmp_path):
    cal = timing.load(_write(tmp_path, {}, {}))
    assert timing.missing(cal, CAND, "sft") == f"no computation measured for {compute_key('sft', CAND)}"


def test_sequence_parallel_candidates_are_left_to_the_estimator(tmp_path):
    """The calibration builds no Ulysses groups, so it measures no sequence-parallel engine and
    the estimator says so instead of pricing one from a measurement of something else."""
    sp = dataclasses.replace(CAND, sequence_parallel=2, attn="sdpa")
    p = plan({"sft": [CAND, sp]})
    assert [e["cand"].sequence_parallel for e in p["compute"].values()] == [1]
    assert all(r["cand"].sequence_parallel == 1 for r in p["runtime"].values())
    cal = timing.load(_write(tmp_path, {}, {}))
    assert timing.missing(cal, sp, "sft") == "the calibration does not measure sequence-parallel engines"


def test_an_old_or_broken_file_names_itself(tmp_path):
    p = tmp_path / "calibration.json"
    p.write_text(json.dumps({"format": 0, "compute": {}, "runtime": {}}))
    with pytest.raises(timing.CalibrationFileError, match=f"{p}: step-time calibration format 0"):
        timing.load(p)
    p.write_text("{")
    with pytest.raises(timing.CalibrationFileError, match="not valid JSON"):
        timing.load(p)


def test_spearman_of_known_orders():
    assert timing.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert timing.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ties take their mean rank: ranks (1.5, 1.5, 3) against (1, 2, 3) -> 0.866
    assert timing.spearman([5, 5, 7], [1, 2, 3]) == pytest.approx(math.sqrt(3) / 2)
    assert math.isnan(timing.spearman([1, 1], [1, 2]))


def test_the_estimator_prices_from_the_calibration_where_it_applies(tmp_path):
    arch = catalog.model("llama-2-7b")
    cand = dataclasses.replace(CAND, precision="bf16", seq_len=512)
    compute = {compute_key("sft", cand): {"1": 0.1, "4": 0.4}}
    runtime = {engine_key(cand): {"micro": {"1": 0.0, "4": 0.0}, "boundary": {"1": 0.2, "4": 0.2}}}
    p = _write(tmp_path, compute, runtime, device="NVIDIA A100-SXM4-80GB", **A100)
    gpu = catalog.gpu("a100-80gb")
    est = estimate(arch, gpu, 2, 1, "sft", cand, settings=Settings(step_time_calibration=str(p)))
    assert est.time_source.startswith("measured 2026-11-26 on NVIDIA A100-SXM4-80GB, 2 ranks x 1 threads (nccl)")
    assert est.step_time_s == pytest.approx(4 * 32 * 0.1 + 0.2)  # 32 layers of 0.1 s, 4 micro steps
    # another world size than the calibration's: the assumed model, saying why
    est8 = estimate(arch, gpu, 8, 1, "sft", cand, settings=Settings(step_time_calibration=str(p)))
    assert (
        est8.time_source.startswith("modelled (each operation at its roofline")
        and "ran 2 ranks, not 8" in est8.time_source
    )
    other = dataclasses.replace(cand, micro_batch=2, grad_accum=8)
    est_missing = estimate(arch, gpu, 2, 1, "sft", other, settings=Settings(step_time_calibration=str(p)))
    assert "no computation measured" in est_missing.time_source


def test_candidates_that_differ_in_zero_share_their_computation():
    z0, z3 = dataclasses.replace(CAND, zero=0), CAND
    assert compute_key("sft", z0) == compute_key("sft", z3)
    assert engine_key(z0) != engine_key(z3)
    assert compute_key("sft", CAND) != compute_key("dpo", CAND)
    assert compute_engine(dataclasses.replace(CAND, offload_optimizer="cpu")) == compute_engine(CAND)


def test_the_calibration_plan_of_the_demo_space_measures_each_engine_once():
    axes = {"zero": [0, 2, 3], "grad_ckpt": [False, True], "micro_batch": [4, 8, 16], "loss_impl": ["full", "chunked"]}
    sft = [dataclasses.replace(c, grad_accum=32 // (2 * c.micro_batch)) for c in enumerate_space(axes, {"seq_len": 24})]
    dpo = [dataclasses.replace(c, ref=r) for c in sft for r in ("model", "precomputed")]
    p = plan({"sft": sft, "dpo": dpo})
    # two ZeRO-0 compute engines (checkpointing off/on) with every batch shape of both methods
    assert len(p["compute"]) == 2
    assert all(len(e["shapes"]) == 6 + 12 for e in p["compute"].values())
    # the ZeRO-2 and ZeRO-3 engines, each measured once; only ZeRO-3 has a sharded reference to time
    assert sorted((r["cand"].zero, r["cand"].grad_ckpt, r["ref"]) for r in p["runtime"].values()) == [
        (2, False, False),
        (2, True, False),
        (3, False, True),
        (3, True, True),
    ]
    # overheads are measured at the smallest SFT batch
    assert all(e["shape0"][0] == "sft" and e["shape0"][1].micro_batch == 4 for e in p["compute"].values())


def test_memfit_estimate_prints_where_its_step_time_comes_from(tmp_path, capsys):
    from memfit.estimate.cli import main

    cand = Candidate(zero=2, micro_batch=1, grad_accum=1, seq_len=512, precision="bf16", attn="sdpa")
    compute = {compute_key("sft", cand): {"1": 0.1, "4": 0.4}}
    runtime = {engine_key(cand): {"micro": {"1": 0.01, "4": 0.04}, "boundary": {"1": 0.2, "4": 0.2}}}
    p = _write(tmp_path, compute, runtime, world_size=1, device="NVIDIA A100-SXM4-80GB", **A100)
    argv = ["--model", "llama-2-7b", "--gpu", "a100-80gb", "--zero", "2", "--seq-len", "512", "--attn", "sdpa"]
    main([*argv, "--no-grad-ckpt", "--step-time-calibration", str(p)])
    out = capsys.readouterr().out
    # 32 layers: compute 0.1 + 31 x 0.1, DeepSpeed 0.01 + 31 x 0.01, the boundary once
    assert "step time 3.720 s" in out and "compute 3.200, deepspeed 0.320, reference 0.000, boundary 0.200" in out
    assert "step time source: measured 2026-11-26 on NVIDIA A100-SXM4-80GB, 1 ranks x 1 threads (nccl)" in out
    main([*argv, "--no-grad-ckpt"])
    assert "step time source: modelled (each operation at its roofline" in capsys.readouterr().out
    assert main([*argv, "--step-time-calibration", str(tmp_path / "nope.json")]) == 2
    assert f"--step-time-calibration {tmp_path / 'nope.json'}: no such file" in capsys.readouterr().err


def _modelled(p, arch=LLAMA, gpu="cpu", world=2):
    """The estimate's time source with calibration `p` (a 512-token ZeRO-3 SFT step)."""
    cand = dataclasses.replace(CAND, precision="bf16" if gpu != "cpu" else "fp32", seq_len=512)
    est = estimate(arch, catalog.gpu(gpu), world, 1, "sft", cand, settings=Settings(step_time_calibration=str(p)))
    return est.time_source


def _priced(tmp_path, **kw):
    """A calibration that measured every figure the step of `_modelled` needs."""
    cands = [dataclasses.replace(CAND, precision=prec, seq_len=512) for prec in ("bf16", "fp32")]
    compute = {compute_key("sft", c): {"1": 0.1, "4": 0.4} for c in cands}
    runtime = {engine_key(c): {"micro": {"1": 0.0, "4": 0.0}, "boundary": {"1": 0.2, "4": 0.2}} for c in cands}
    return _write(tmp_path, compute, runtime, **kw)


def test_a_calibration_of_another_model_is_refused_naming_both(tmp_path):
    """Issue #41: the 3M-parameter demo's calibration priced a 1.2B model "measured"."""
    demo = catalog.model("llama-3.2-1b")
    p = _priced(tmp_path, arch=dataclasses.replace(demo, hidden_size=64, intermediate_size=128, num_layers=2))
    src = _modelled(p, arch=demo)
    assert not src.startswith("measured"), src
    assert f"the calibration {p} measured another model" in src and "hidden_size 64 vs 2048" in src
    assert "re-run calibrate for this model" in src
    # the same layer shape at another depth is priced per layer, and the source says so
    deeper = _priced(tmp_path, arch=dataclasses.replace(LLAMA, num_layers=4))
    assert "scaled from 4 to 32 decoder layers" in _modelled(deeper)


@pytest.mark.parametrize(
    ("meta", "gpu", "reason"),
    [
        ({}, "h100-80gb", "ran on the CPU, not on h100-80gb"),
        (
            H100 | {"device": "NVIDIA H100 80GB HBM3"},
            "a100-80gb",
            "ran on NVIDIA H100 80GB HBM3 (h100-80gb), not on a100-80gb",
        ),
        (A100, "h100-80gb", "ran on NVIDIA A100-SXM4-80GB (a100-80gb), not on h100-80gb"),
        ({"backend": "mpi"}, "cpu", "the calibration ran the mpi backend, not gloo"),
    ],
)
def test_a_calibration_of_another_device_or_backend_is_refused(tmp_path, meta, gpu, reason):
    src = _modelled(_priced(tmp_path, **meta), gpu=gpu)
    assert not src.startswith("measured") and reason in src, src
    assert _modelled(_priced(tmp_path, **H100), gpu="h100-80gb").startswith("measured")


def test_a_calibration_recorded_before_identities_is_refused_with_the_way_out(tmp_path):
    p = _priced(tmp_path)
    d = json.loads(p.read_text())
    for key in ("model", "device_name", "device_total_bytes"):
        del d[key]
    p.write_text(json.dumps(d))
    src = _modelled(p)
    assert not src.startswith("measured") and f"the calibration {p} was recorded before memfit recorded" in src
    assert "re-run calibrate" in src


def test_memfit_estimate_names_a_calibration_of_another_model_instead_of_pricing_from_it(tmp_path, capsys):
    """As issue #41 met it: the demo's calibration given to `memfit estimate` for a 1.2B model."""
    from memfit.estimate.cli import main

    demo = dataclasses.replace(catalog.model("llama-3.2-1b"), name="demo-tiny", hidden_size=64, num_layers=2)
    cand = Candidate(zero=2, micro_batch=1, grad_accum=1, seq_len=512, precision="bf16", attn="sdpa")
    compute = {compute_key("sft", cand): {"1": 0.1, "2": 0.2}}
    runtime = {engine_key(cand): {"micro": {"1": 0.0, "2": 0.0}, "boundary": {"1": 0.2, "2": 0.2}}}
    p = _write(tmp_path, compute, runtime, arch=demo, world_size=1, device="NVIDIA A100-SXM4-80GB", **A100)
    argv = ["--model", "llama-3.2-1b", "--gpu", "a100-80gb", "--zero", "2", "--seq-len", "512", "--attn", "sdpa"]
    assert main([*argv, "--no-grad-ckpt", "--step-time-calibration", str(p)]) == 0
    out = capsys.readouterr().out
    assert f"the calibration {p} measured another model, demo-tiny, not llama-3.2-1b (hidden_size 64 vs 2048" in out
    assert "step time source: measured" not in out


# -- DeepSpeedCPUAdam measured by the calibrate rule (#42) ------------------------------------------
OFFLOAD = Candidate(zero=2, offload_optimizer="cpu", micro_batch=1, grad_accum=1, seq_len=512, precision="bf16")
ADAM = {
    "block_params": 2**24,
    "dtype": "fp32",
    "seconds": 0.16777216,
    "params_per_s_per_rank": 1e8,
    "threads_per_rank": 4,
}


def _offload_estimate(p, gpu="a100-80gb", **settings):
    """llama-2-7b ZeRO-2 with optimizer offload on 8 GPUs: a candidate the calibration `p` does not
    hold (it measured no engine), so its step is the modelled one."""
    s = Settings(step_time_calibration=str(p) if p else None, **settings)
    return estimate(LLAMA, catalog.gpu(gpu), 8, 1, "sft", OFFLOAD, settings=s)


def test_the_modelled_offload_step_prices_the_cpu_adam_rate_calibrate_measured(tmp_path):
    (tmp_path / "m").mkdir()
    measured = _write(tmp_path / "m", {}, {}, world_size=8, device="NVIDIA A100-SXM4-80GB", cpu_adam=ADAM, **A100)
    plain = _write(tmp_path, {}, {}, world_size=8, device="NVIDIA A100-SXM4-80GB", **A100)
    with_rate, without = _offload_estimate(measured), _offload_estimate(plain)
    assert "DeepSpeedCPUAdam at 1e+08 params/s per rank (measured by calibrate 2026-11-26 on NVIDIA A100" in (
        with_rate.time_source
    )
    assert "16,777,216 fp32 parameters, 4 thread(s) a rank" in with_rate.time_source
    assert "DeepSpeedCPUAdam at 5.4e+08 params/s per core x 4 cores per rank (default" in without.time_source
    # each rank steps its eighth of the parameters at the measured rate instead of the default's 2.16e9
    from memfit.estimate.models.params import trainable_params

    share = trainable_params(LLAMA, OFFLOAD, Settings()) / 8
    expect = share * (1 / 1e8 - 1 / (5.4e8 * 4))
    assert with_rate.time_breakdown["offload"] - without.time_breakdown["offload"] == pytest.approx(expect)
    assert with_rate.step_time_s > without.step_time_s
    # a rate given (flag or config) wins over the measured one, and the output says it was given
    given = _offload_estimate(measured, cpu_adam_params_per_s_per_core=1e9)
    assert "DeepSpeedCPUAdam at 1e+09 params/s per core x 4 cores per rank (as given" in given.time_source
    # measured on another GPU's machine: not this host's rate
    elsewhere = _offload_estimate(measured, gpu="h100-80gb")
    assert "measured by calibrate" not in elsewhere.time_source and "(default" in elsewhere.time_source
    # no offload, no CPU-Adam in the source
    on_device = estimate(LLAMA, catalog.gpu("a100-80gb"), 8, 1, "sft", dataclasses.replace(OFFLOAD, offload_optimizer="none"),
                         settings=Settings(step_time_calibration=str(measured)))  # fmt: skip
    assert "DeepSpeedCPUAdam" not in on_device.time_source


@pytest.mark.parametrize("bad", [{"params_per_s_per_rank": 0}, {"params_per_s_per_rank": "fast"}, {}, 5])
def test_a_broken_cpu_adam_measurement_names_the_file_and_key(tmp_path, bad, capsys):
    from memfit.estimate.cli import main

    p = _write(tmp_path, {}, {}, cpu_adam=bad)
    argv = ["--model", "llama-2-7b", "--gpu", "cpu", "--num-gpus", "2", "--offload-optimizer", "cpu"]
    assert main([*argv, "--step-time-calibration", str(p)]) == 2
    err = capsys.readouterr().err
    assert f"{p}: cpu_adam.params_per_s_per_rank must be a positive rate" in err and "Traceback" not in err


def test_a_model_measured_whole_is_priced_at_its_own_depth_and_between_depths_linearly(tmp_path):
    # 1, 4 and 24 layers measured (memfit.train.calibrate.depths measures a cheap deep model whole):
    # the 24-layer model gets its own figure, not the 1-to-4 slope (issue #42: 1.6-2.0x long on an H200)
    p = _write(
        tmp_path,
        {compute_key("sft", CAND): {"1": 0.010, "4": 0.040, "24": 0.140}},
        {
            engine_key(CAND): {
                "micro": {"1": 0.0, "4": 0.0, "24": 0.0},
                "boundary": {"1": 0.005, "4": 0.020, "24": 0.030},
            }
        },
        layers=[1, 4, 24],
    )
    cal = timing.load(p)
    at24 = timing.predict(cal, CAND, "sft", num_layers=24)
    assert at24["compute"] == pytest.approx(4 * 0.140) and at24["boundary"] == pytest.approx(0.030)
    assert timing.predict(cal, CAND, "sft", num_layers=14)["compute"] == pytest.approx(4 * 0.090)  # halfway 4..24
    assert timing.predict(cal, CAND, "sft", num_layers=2)["compute"] == pytest.approx(4 * 0.020)  # on 1..4
    assert timing.predict(cal, CAND, "sft", num_layers=44)["compute"] == pytest.approx(4 * 0.240)  # the last two


def test_a_calibration_of_one_depth_prices_that_depth_only(tmp_path):
    """A model of at most 4 layers is measured whole only (memfit.train.calibrate.depths): the same
    layer shape at another depth has no per-layer figure to scale, so it is refused, naming the
    depths; at its own depth the step is the measured one."""
    one = {"4": 0.4}
    compute = {compute_key("sft", dataclasses.replace(CAND, precision="fp32", seq_len=512)): one}
    runtime = {engine_key(CAND): {"micro": {"4": 0.0}, "boundary": {"4": 0.2}}}
    shallow = dataclasses.replace(LLAMA, num_layers=4)
    p = _write(tmp_path, compute, runtime, arch=shallow, layers=[4])
    assert _modelled(p, arch=shallow).startswith("measured")
    src = _modelled(p)  # the 32-layer model of the same layer shape
    assert not src.startswith("measured")
    assert f"the calibration {p} measured llama-2-7b whole at 4 decoder layers only, not 32" in src, src


def test_the_calibration_measures_the_model_whole_only_where_that_is_cheap():
    from memfit.train.calibrate import MAX_LAYERS, WHOLE_MODEL_MEMORY, WHOLE_MODEL_S, depths

    assert depths(4) == depths(4, 1.0) == [4]  # a model of at most MAX_LAYERS layers: whole, at its depth only
    assert depths(2) == [2] and depths(1) == [1]
    assert depths(24) == [1, MAX_LAYERS]  # before the 4-layer pass: nothing to project from
    assert depths(24, 20.0) == [1, 4, 24]  # 20 s at 4 layers: about 120 s at 24
    assert depths(80, WHOLE_MODEL_S / 10) == [1, 4]  # projected 2x the budget: extrapolated
    assert depths(24, 20.0, WHOLE_MODEL_MEMORY / 4) == [1, 4]  # quick, but 6x its 4-layer peak would not fit
