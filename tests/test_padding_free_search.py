"""`padding_free` as a search lever (issue #45): `search: padding_free: [false, true]` gives both
candidates, the methods and sequence parallelism it does not apply to are refused naming the key,
the estimator prices the one row's memory (measured against the trainer's step) and its compute on
the data's tokens (the selection compares them), and a padding_free probe runs through the library.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import yaml

from memfit.estimate import Settings, estimate
from memfit.estimate import main as estimate_main
from memfit.estimate.models import catalog
from memfit.estimate.time import timing
from memfit.space import Candidate
from memfit.workflow.config import ConfigError, WorkflowConfig, validate_config


@pytest.fixture()
def config(repo, monkeypatch):
    monkeypatch.chdir(repo)  # config paths are relative to the repository root
    return yaml.safe_load((repo / "config/config.yaml").read_text())


# -- the search space ---------------------------------------------------------------------------
def test_search_padding_free_gives_both_candidates_and_the_padded_ids_stay(config, tmp_path):
    before = WorkflowConfig.load(copy.deepcopy(config))
    config["search"]["padding_free"] = [False, True]
    cfg = WorkflowConfig.load(config)
    for method in ("sft", "dpo"):
        cands = cfg.candidates(method)
        padded = [c for c in cands if not c.padding_free]
        free = [c for c in cands if c.padding_free]
        assert [c.id for c in padded] == [c.id for c in before.candidates(method)]  # ids of existing configs
        assert [c.id for c in free] == [c.id + "-pf" for c in padded]
        assert len({c.id for c in cands}) == len(cands)
        # the probe and the training of the padding_free candidate run the trainer padding-free
        run = cfg.run_config(method, free[0].to_dict(), str(tmp_path / "m"), str(tmp_path / "d"), str(tmp_path / "o"))
        assert run.padding_free and run.cand.padding_free
        assert not cfg.run_config(method, padded[0].to_dict(), "m", "d", "o").padding_free


def test_padding_free_for_a_method_it_does_not_apply_to_names_the_key(repo, monkeypatch):
    monkeypatch.chdir(repo)
    pref = yaml.safe_load((repo / "config/preference.yaml").read_text())
    both = copy.deepcopy(pref)
    both["search"]["padding_free"] = [False, True]
    cfg = WorkflowConfig.load(both)  # KTO keeps its padded candidates; rm, ORPO, SimPO get both
    assert any(c.padding_free for c in cfg.candidates("sft"))
    for method in ("rm", "orpo", "simpo"):
        assert any(c.padding_free for c in cfg.candidates(method)), method
    assert cfg.candidates("kto") and not any(c.padding_free for c in cfg.candidates("kto"))
    only = copy.deepcopy(pref)
    only["search"]["padding_free"] = [True]
    with pytest.raises(
        ConfigError, match=r"search\.padding_free \[True\]: padding_free: applies to sft, dpo, rm, orpo, simpo only"
    ):
        validate_config(only)


def test_padding_free_with_sequence_parallelism_names_both_keys(config):
    config["methods"] = ["sft"]
    config["search"] |= {"padding_free": [True], "sequence_parallel": [2]}
    with pytest.raises(ConfigError, match=r"search\.padding_free \[True\], search\.sequence_parallel \[2\]"):
        validate_config(config)


def test_memfit_estimate_refuses_padding_free_where_the_trainer_does(capsys):
    argv = ["--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--padding-free"]
    assert estimate_main([*argv, "--method", "kto", "--micro-batch", "2"]) == 2
    assert "--padding-free: applies to sft, dpo, rm, orpo, simpo only" in capsys.readouterr().err
    assert estimate_main(["--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--row-tokens", "100"]) == 2
    assert "--row-tokens does nothing without --padding-free" in capsys.readouterr().err


# -- memory: the one row, measured --------------------------------------------------------------
# The trainer's step (memfit.train.steps.StepRunner, padding_free) on the tiny Llama of
# test_estimate_groundtruth (4 heads over 2 KV heads, LoRA, fp32), rows of 256 tokens.
# Measured 2026-11-28: SFT sdpa mb2 +0.1%, with checkpointing +1.2%, eager +1.7%; DPO sdpa mb1
# (reference model) -0.1% (memfit's per-sequence sdpa; transformers' block mask: +0.1%, +0.9%, -2.8%).
MEASURED = {
    "sft-sdpa": ("sft", dict(attn="sdpa", micro_batch=2)),
    "sft-sdpa-gc": ("sft", dict(attn="sdpa", micro_batch=2, grad_ckpt=True)),
    "sft-eager": ("sft", dict(attn="eager", micro_batch=2)),
    "dpo-sdpa": ("dpo", dict(attn="sdpa", micro_batch=1, ref="model")),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MEASURED))
def test_a_padding_free_step_peaks_where_the_estimate_says(name):
    import test_estimate_groundtruth as gt

    method, kw = MEASURED[name]
    base = dict(zero=0, precision="fp32", seq_len=256, finetune="lora", lora_rank=8, grad_ckpt=False, ref=None)
    cand = Candidate(**(base | kw | {"padding_free": True}))
    settings = Settings(optimizer_impl="single", zero0_engine="torch")
    measured = gt.measure("llama", method, cand)
    predicted = estimate(gt.make_arch("llama"), gt.CPU, 1, 1, method, cand, settings=settings).training_peak_bytes
    assert abs(predicted / measured - 1) <= 0.04, (name, predicted, measured)
    if kw["attn"] == "sdpa" and not cand.grad_ckpt:
        # memfit's per-sequence sdpa (memfit.train.varlen_attention) keeps no [T, T] mask: over the
        # same rows unpadded, the row adds its gathered attention output and two int64 indices a
        # layer (0.31 MB here, where transformers' block-causal mask added 2.4-2.7 MB), as estimated
        plain = dataclasses.replace(cand, padding_free=False)
        unpadded = estimate(
            gt.make_arch("llama"), gt.CPU, 1, 1, method, plain, settings=Settings(optimizer_impl="single", zero0_engine="torch", padding_mask=False)
        ).training_peak_bytes  # fmt: skip
        grown = measured - gt.measure("llama", method, plain)
        T = cand.micro_batch * (2 if method == "dpo" else 1) * 256
        assert 0 < grown < 4 * T**2  # less than one layer's fp32 copy of a [T, T] mask
        assert abs((predicted - unpadded) / grown - 1) <= 0.10, (name, predicted - unpadded, grown)


# -- time: the data's tokens against the padded rows -------------------------------------------
def _ranked(extra: list[str], capsys) -> dict:
    argv = ["--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--finetune", "lora", "--micro-batch", "8"]
    estimate_main([*argv, "--seq-len", "4096", "--budget-gb", "400", "--padding-free", "on,off", *extra, "--json"])
    return json.loads(capsys.readouterr().out)


def test_the_selection_takes_padding_free_where_it_computes_less(capsys):
    # flash-attention's varlen kernel and memfit's per-sequence sdpa: each sequence's own square, the
    # rows' own tokens, so even rows nearly seq_len long save their padding
    flash = _ranked(["--attn", "flash", "--row-tokens", "2000"], capsys)
    assert flash["selected"].endswith("-pf")
    sdpa = _ranked(["--attn", "sdpa", "--row-tokens", "4000"], capsys)
    assert sdpa["selected"].endswith("-pf")
    # eager: the one row's T x T attention, masked; with rows nearly seq_len long it costs more than
    # the padding it saves, so the padded one is selected
    eager = _ranked(["--attn", "eager", "--row-tokens", "4000"], capsys)
    assert not eager["selected"].endswith("-pf")


def test_the_estimate_keeps_the_worst_case_its_probe_runs():
    arch, gpu = catalog.model("qwen2.5-0.5b"), catalog.gpu("h100-80gb")
    cand = Candidate(zero=0, attn="flash", finetune="lora", micro_batch=4, seq_len=2048, padding_free=True)
    padded = estimate(arch, gpu, 1, 1, "sft", Candidate(**(cand.to_dict() | {"padding_free": False})))
    worst = estimate(arch, gpu, 1, 1, "sft", cand)  # no data statistics: the worst case
    real = estimate(arch, gpu, 1, 1, "sft", cand, settings=Settings(row_tokens=512))
    assert worst.step_time_s == worst.step_time_worst_case_s == pytest.approx(padded.step_time_s, rel=1e-6)
    assert real.step_time_worst_case_s == worst.step_time_s
    # a quarter of the tokens (LoRA: 4 FLOPs a parameter a token), less of flash's per-sequence square;
    # what a step adds beyond its computation (the optimizer, the engine) stays
    assert real.time_breakdown["compute"] < 0.26 * worst.time_breakdown["compute"]
    assert {k: v for k, v in real.time_breakdown.items() if k != "compute"} == {
        k: v for k, v in worst.time_breakdown.items() if k != "compute"
    }
    assert any("512 tokens a sequence" in n for n in real.notes)
    assert "step_time_worst_case_s" not in padded.to_dict()  # padded rows' JSON as before


# -- a probe through the library ------------------------------------------------------------------
@pytest.mark.slow
def test_a_padding_free_probe_measures_what_the_estimate_predicts(demo_model, demo_data, tmp_path):
    """2 ranks of DeepSpeed on the CPU, the demo model, the worst case (every sequence seq_len
    tokens in the one row): peak allocated bytes within the 10% of tests/test_estimate_deepspeed.py,
    and the probe compared with the worst-case step time it runs."""
    from memfit.train.run_config import RunConfig
    from memfit.workflow.pipeline import _row_tokens
    from memfit.workflow.probe import run_probe

    cand = Candidate(zero=0, attn="sdpa", precision="fp32", finetune="full", micro_batch=4, seq_len=32, grad_accum=4, ref=None, padding_free=True)  # fmt: skip
    settings = Settings(row_tokens=_row_tokens(demo_data / "sft" / "stats.json"))
    est = estimate(catalog.model(str(demo_model)), catalog.gpu("cpu"), 2, 1, "sft", cand, budget_bytes=8 * 2**30, settings=settings)  # fmt: skip
    run = RunConfig(method="sft", model_path=str(demo_model), data_dir=str(demo_data / "sft"), out_dir=str(tmp_path / "o"), candidate=cand.to_dict())  # fmt: skip
    res = run_probe(
        run, nproc=2, out_json=tmp_path / "p.json", log=tmp_path / "p.log", steps=2, prediction=est.to_dict()
    )
    assert res["status"] == "ok", res
    assert res["id"].endswith("-pf") and json.loads((tmp_path / "p.json").read_text())["candidate"]["padding_free"]
    assert abs(res["peak_allocated_bytes"] / est.training_peak_bytes - 1) <= 0.10, (res, est.phases)
    assert res["predicted"]["step_time_s"] == est.step_time_worst_case_s > est.step_time_s


def test_the_exports_carry_a_searched_padding_free(tmp_path):
    """A padding_free candidate (not a run config key) reaches every trainer's file: TRL's
    `padding_free`, OpenRLHF's --ds.packing_samples, and LLaMA-Factory says it has none."""
    import test_exports

    from memfit import exports

    files = exports.write_all(test_exports._plan(tmp_path, "sft", {"zero": 0, "padding_free": True}))
    trl = json.loads(files["hf_args"].read_text())
    assert '"padding_free": true' in json.dumps(trl)
    assert "--ds.packing_samples" in files["openrlhf"].read_text()
    assert "padding_free: LLaMA-Factory pads every batch" in files["llamafactory"].read_text()


def test_a_padding_free_probe_is_priced_on_the_data_like_its_estimate():
    """The probe ran the worst case; the selection scales its measured step by the estimate's ratio
    of the data's rows to that worst case, so padded and padding_free candidates compare on the data."""
    from memfit.estimate.rows import Budget
    from memfit.estimate.selection import judge

    arch, gpu = catalog.model("qwen2.5-0.5b"), catalog.gpu("h100-80gb")
    cands = [Candidate(zero=0, attn="flash", micro_batch=4, seq_len=2048, padding_free=pf) for pf in (False, True)]
    rows = [
        estimate(arch, gpu, 1, 1, "sft", c, settings=Settings(row_tokens=512)).to_dict() | {"id": c.id, "candidate": c.to_dict()}
        for c in cands
    ]  # fmt: skip
    probe = {"status": "ok", "peak_allocated_bytes": 2**30, "step_time_s": 1.0}
    judged = judge(rows, {c.id: probe | {"id": c.id} for c in cands}, Budget(80 * 2**30, 2**40, 0.05), 1, "sft")
    padded, free = (r.figures.step_time_s for r in judged)
    assert padded == 1.0 and free == pytest.approx(rows[1]["step_time_s"] / rows[1]["step_time_worst_case_s"])
    assert free < padded


@pytest.mark.slow
def test_the_calibration_measures_the_padding_free_row_and_prices_it(demo_model, tmp_path):
    """The calibrate ranks measure a padding_free candidate's batch as a shape of its own (its
    compute key), and the estimate prices its worst case from that measurement, then the data's rows."""
    from test_calibrate import _calibrate

    from memfit.estimate.models.hf_config import arch_from_hf_config
    from memfit.space import compute_key

    padded = Candidate(zero=0, micro_batch=4, grad_accum=4, seq_len=16, precision="fp32", ref=None)
    free = dataclasses.replace(padded, padding_free=True)
    cal = _calibrate(demo_model, tmp_path, {"sft": [padded, free]})
    d = json.loads(cal.read_text())
    assert set(d["compute"]) == {compute_key("sft", padded), compute_key("sft", free)}
    assert compute_key("sft", free) == compute_key("sft", padded) + "|padding_free"
    arch = arch_from_hf_config(json.loads((demo_model / "config.json").read_text()), name="demo-tiny")
    settings = Settings(step_time_calibration=str(cal), row_tokens=12)
    est = estimate(arch, catalog.gpu("cpu"), 2, 1, "sft", free, budget_bytes=2**30, settings=settings)
    assert est.time_source.startswith("measured"), est.time_source
    worst = timing.predict(timing.load(cal), free, "sft", arch.num_layers)
    assert est.step_time_worst_case_s == pytest.approx(sum(worst.values()), abs=2e-6)
    assert est.time_breakdown["compute"] < worst["compute"]  # 12 of 16 tokens a sequence


def test_the_report_names_the_speed_levers_of_a_candidate():
    from memfit.report.fmt import describe

    said = describe(Candidate(zero=0, padding_free=True, compile=True).to_dict(), "sft", 2)
    assert said.endswith("padding-free rows, compiled layers"), said
    assert "padding-free" not in describe(Candidate(zero=0).to_dict(), "sft", 2)
