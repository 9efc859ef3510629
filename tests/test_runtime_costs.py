"""The modelled (uncalibrated) step time against the H100 and H200 evidence rows (issue #42), and
the DeepSpeedCPUAdam rate as a setting the estimate names."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import pytest
from memfit_validation.memory import EVIDENCE_FILES, evidence_rows

from memfit.estimate import Settings, estimate
from memfit.estimate.models import catalog
from memfit.estimate.settings import EstimateError
from memfit.estimate.time import runtime_costs
from memfit.space import Candidate

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
EVIDENCE = EVIDENCE_FILES


def _rows(gpu: str) -> dict[str, tuple[float, float]]:
    """Every measured evidence row of `gpu`: (measured, modelled) seconds per step."""
    return {rid: (measured, est.step_time_s) for rid, measured, est in evidence_rows(RESULTS, gpu)}


@pytest.mark.parametrize("gpu", sorted(EVIDENCE))
def test_uncalibrated_step_time_meets_the_issue_bars_on_the_evidence_rows(gpu):
    """#42: median |error| <= 20%, worst <= 40%, and ZeRO-0/2/3 in the measured order. The constants
    were fitted on the H200's step-time calibration stage, none on these rows (runtime_costs'
    docstring)."""
    rows = _rows(gpu)
    errors = [abs(pred / meas - 1) for meas, pred in rows.values()]
    assert statistics.median(errors) <= 0.20 and max(errors) <= 0.40, rows
    zero = [rows[f"sft-full-z{z}"] for z in (0, 2, 3)]
    assert sorted(zero) == zero and [p for _, p in zero] == sorted(p for _, p in zero), zero


def test_cpu_adam_rate_is_a_setting_and_the_estimate_names_it():
    arch, gpu = catalog.model("qwen2.5-7b"), catalog.gpu("h100-80gb")
    cand = Candidate(zero=2, offload_optimizer="cpu", seq_len=2048)
    slow = estimate(arch, gpu, 8, 1, "sft", cand, settings=Settings(cpu_adam_params_per_s_per_core=1e8))
    fast = estimate(arch, gpu, 8, 1, "sft", cand)
    assert slow.time_breakdown["offload"] > fast.time_breakdown["offload"]
    assert "DeepSpeedCPUAdam at 5.4e+08 params/s per core x 4 cores per rank (default" in fast.time_source
    assert "1e+08 params/s per core x 4 cores per rank (as given: --cpu-adam-rate" in slow.time_source
    plain = estimate(arch, gpu, 8, 1, "sft", Candidate(zero=2, seq_len=2048))
    assert "DeepSpeedCPUAdam" not in plain.time_source


@pytest.mark.parametrize(
    ("cfg", "words"),
    [
        ({"cpu_cores_per_rank": 0}, "estimate.cpu_cores_per_rank: 0 is not a positive whole number"),
        ({"cpu_cores_per_rank": 2.5}, "estimate.cpu_cores_per_rank: 2.5 is not a positive whole number"),
        ({"cpu_adam_params_per_s_per_core": "fast"}, "estimate.cpu_adam_params_per_s_per_core: 'fast' is not a"),
    ],
)
def test_bad_cpu_adam_config_values_name_their_key(cfg, words):
    with pytest.raises(EstimateError, match=words):
        runtime_costs.cpu_adam_settings(cfg)
    assert runtime_costs.cpu_adam_settings({"cpu_cores_per_rank": 16}) == {"cpu_cores_per_rank": 16}


def test_zero3_host_constants_reproduce_the_h200_calibration_they_were_fitted_on():
    """ZERO3_MODULE_S and ZERO3_MICRO_S come from the H200 calibration's ZeRO-3 `runtime.micro`
    (1 and 4 layers, seq 2048): the modelled micro step beyond ZeRO-0's computation (the gathered
    copies plus the exposed host time) gives both figures back within 1%."""
    doc = json.loads((RESULTS / EVIDENCE["h200"]).read_text())
    cal = doc["stages"]["step_time"]["rows"][0]["calibration"]
    micro = next(v["micro"] for k, v in cal["runtime"].items() if k.startswith("zero=3|") and "finetune=full" in k)
    gpu, cand = catalog.gpu("h200"), Candidate(zero=3, seq_len=2048)
    for layers in (1, 4):
        arch = dataclasses.replace(catalog.model("llama-3.1-8b"), num_layers=layers)
        total = runtime_costs.param_layout(arch).total
        bw = runtime_costs.roofline.rates(gpu, "bf16").memory
        got = runtime_costs.zero_runtime_seconds(arch, cand, gpu, "sft", total, total, bw, Settings())["gather"]
        assert got == pytest.approx(micro[str(layers)], rel=0.01), (layers, got, micro)


def test_zero3_hooks_hide_under_long_kernels():
    """A module's fetch/release host time hides under its own kernels: per token, ZeRO-3's gather
    term falls as sequences grow (Qwen2.5-7B, 2 H100s), and a 4-layer model at 256 tokens pays
    the whole host cost of its modules."""
    arch, gpu = catalog.model("qwen2.5-7b"), catalog.gpu("h100-80gb")

    def gather(seq: int, model=arch) -> float:
        est = estimate(model, gpu, 2, 1, "sft", Candidate(zero=3, seq_len=seq, grad_ckpt=True))
        return est.time_breakdown["zero3_gather"]

    per_token = [gather(s) / s for s in (256, 1024, 4096)]
    assert per_token == sorted(per_token, reverse=True) and per_token[-1] < per_token[0] / 4, per_token
    small = dataclasses.replace(arch, num_layers=4)
    modules = runtime_costs.gathered_modules(small)
    assert gather(256, small) >= 3 * modules * runtime_costs.ZERO3_MODULE_S * 0.8


def _plan(repo, tmp_path, monkeypatch, estimate_cfg: dict) -> dict:
    """The cluster example's plan-only estimate of Qwen2.5-7B on A100s with `estimate_cfg`."""
    import yaml

    from memfit.workflow import pipeline
    from memfit.workflow.config import WorkflowConfig

    monkeypatch.chdir(repo)
    raw = yaml.safe_load((repo / "config/cluster-example.yaml").read_text())
    raw.update(plan_only=True, estimate={"activations": "analytic", **estimate_cfg})
    out = tmp_path / f"c{len(estimate_cfg)}.json"
    return pipeline.estimate_candidates(WorkflowConfig.load(raw), "qwen2.5-7b", "a100-80gb", "sft", out)


def test_workflow_config_cpu_adam_rate_reaches_the_estimates(repo, tmp_path, monkeypatch):
    """`estimate.cpu_adam_params_per_s_per_core` / `estimate.cpu_cores_per_rank` in the workflow
    config price every offload_optimizer: cpu candidate of the plan and are named in its time
    source; candidates without offload are untouched."""
    default = {r["id"]: r for r in _plan(repo, tmp_path, monkeypatch, {})["rows"]}
    slow = _plan(repo, tmp_path, monkeypatch, {"cpu_adam_params_per_s_per_core": 1e8, "cpu_cores_per_rank": 2})
    offloaded = [r for r in slow["rows"] if r["candidate"]["offload_optimizer"] == "cpu" and not r["invalid"]]
    assert offloaded
    for r in offloaded:
        assert "1e+08 params/s per core x 2 cores per rank (as given: --cpu-adam-rate" in r["time_source"], r["id"]
        assert r["time_breakdown"]["offload"] > default[r["id"]]["time_breakdown"]["offload"], r["id"]
    for r in slow["rows"]:
        if r["candidate"]["offload_optimizer"] != "cpu" and not r["invalid"]:
            assert r["step_time_s"] == default[r["id"]]["step_time_s"], r["id"]


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [("cpu_cores_per_rank", 0, "cpu_cores_per_rank"), ("cpu_adam_params_per_s_per_core", -1, "cpu_adam_params_per_s")],
)
def test_check_config_refuses_a_bad_cpu_adam_value_naming_the_key(repo, tmp_path, capsys, key, value, words):
    """`memfit check-config` (what the Snakefile runs first) exits 2 naming the offending key."""
    import yaml

    from memfit.workflow import check_config

    raw = yaml.safe_load((repo / "config/cluster-example.yaml").read_text())
    raw["estimate"] = {"activations": "analytic", key: value}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert check_config.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert "estimate" in err and words in err and "Traceback" not in err, err
