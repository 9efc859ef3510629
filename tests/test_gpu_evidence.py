"""benchmarks/gpu_evidence.py in its CPU dry form, and the calibration files the estimator reads.

The dry run is the GPU script's own code path (real `memfit.workflow.probe.run_probe` probes against
`memfit.estimate.estimate`) with the demo model reduced to 2 layers, seq_len 24, fp32, one
probe per stage; CUDA-only rows must say why they were skipped."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from memfit.estimate import estimate
from memfit.estimate.models import calibration, catalog
from memfit.estimate.time.costs import step_flops
from memfit.space import Candidate
from memfit.units import MIB


def test_uncalibrated_defaults_are_the_stated_heuristics(tmp_path):
    h100 = calibration.for_gpu("h100-80gb", "9.0", directory=tmp_path)
    a100 = calibration.for_gpu("a100-80gb", "8.0", directory=tmp_path)
    assert not h100.measured and h100.label() == "uncalibrated (stated heuristics)"
    # the CUDA context and cuBLAS beside the allocator on Hopper: what the H100 and the H200 both measured
    assert (h100.cuda_context_bytes, h100.cublas_workspace_bytes) == (648_871_936, 69_206_016)
    assert calibration.for_gpu("a100-80gb", "8.0", directory=tmp_path).cuda_context_bytes == 500 * MIB
    assert a100.cublas_workspace_bytes == 9 * MIB
    # the workspaces inside it: two handles (forward and autograd's thread) of PyTorch's default size
    assert calibration.allocator_workspaces(h100, "9.0") == 64 * MIB
    assert calibration.allocator_workspaces(a100, "8.0") == 2 * 8_519_680
    assert calibration.for_gpu("cpu", "cpu", directory=tmp_path).cuda_context_bytes == 0


def test_estimate_uses_a_measured_calibration_and_says_so(tmp_path, monkeypatch):
    arch, gpu = catalog.model("llama-3.1-8b"), catalog.gpu("h100-80gb")
    cand = Candidate(zero=2, finetune="lora", seq_len=2048)
    monkeypatch.setattr(calibration, "CALIBRATION_DIR", tmp_path)
    before = estimate(arch, gpu, 1, 1, "sft", cand)
    assert before.calibration == "uncalibrated (stated heuristics)"
    (tmp_path / "h100-80gb.json").write_text(
        json.dumps(
            {
                "device": "h100-80gb",
                "measured_on": "2026-11-22",
                "measured_device": "NVIDIA H100 80GB HBM3",
                "cuda_context_bytes": 600 * MIB,
                "cublas_workspace_bytes": 32 * MIB,
                "fragmentation": 0.0,
                "tflops": {"step": 400.0},
            }
        )
    )
    after = estimate(arch, gpu, 1, 1, "sft", cand)
    assert after.calibration == "measured 2026-11-22 on NVIDIA H100 80GB HBM3"
    assert after.peak_allocated_bytes == before.peak_allocated_bytes
    # reserved comes from the allocator's mechanisms (memfit.estimate.memory.allocator); the file's
    # `fragmentation` is for the record, its `logits_cached_share` absent: the default share
    assert after.peak_reserved_bytes == before.peak_reserved_bytes > after.peak_allocated_bytes
    assert after.device_total_bytes - after.peak_reserved_bytes == 632 * MIB
    # a measured whole-step rate replaces the per-operation roofline: the step's FLOPs at 400 TFLOP/s
    assert after.time_breakdown["compute"] == pytest.approx(step_flops(arch, cand, "sft") / 400e12)
    assert after.time_source.startswith("measured whole-step TFLOP/s") and before.time_source.startswith("modelled")


@pytest.mark.parametrize(
    "bad, key",
    [
        ({"cuda_context_bytes": -1}, "cuda_context_bytes"),
        ({"tflops": {"conv": 1.0}}, "tflops.conv"),
        ({"fragmentation": 3}, "fragmentation"),
        ({"hbm_gbs": -1}, "hbm_gbs"),
        ({"measured_on": ""}, "measured_on"),
        ({"colour": 1}, "colour"),
    ],
)
def test_bad_calibration_files_name_the_key(tmp_path, bad, key):
    d = {"device": "h100-80gb", "measured_on": "2026-11-22", "cuda_context_bytes": 1, "cublas_workspace_bytes": 1}
    (tmp_path / "h100-80gb.json").write_text(json.dumps(d | bad))
    with pytest.raises(calibration.CalibrationError, match=key):
        calibration.for_gpu("h100-80gb", "9.0", directory=tmp_path)


# The dry run's 11 stages in four parts, one test each (together about 4 min on 2 cores, a part
# with the long-context fit's two probes took 113 s; one test may take at most 60 s): the CUDA-only
# skips and three probe stages; a probe stage and the step-time calibration that prices its probe;
# the attention and allocator stages and the long-context fit; the trainer-speed benchmark (32 s at
# load 3-4, 2026-11-28).
HALVES = {
    "a": ["context", "sdpa_long", "sft_zero", "dpo_ref", "qlora"],
    "b": ["sft_gc_lora", "step_time"],
    "c": ["attention", "allocator", "long_context"],
    "d": ["trainer_speed"],
}
CUDA_ONLY = {"sft-full-z2-flash": "c", "sft-full-z2-expandable-on": "c"}


def test_the_halves_cover_every_stage_once(repo):
    listed = subprocess.run(
        [sys.executable, str(repo / "benchmarks/gpu_evidence.py"), "--list-stages"], capture_output=True, text=True
    ).stdout
    stages = [line.split()[0] for line in listed.splitlines()]
    assert len(stages) == 11 and sorted(stages) == sorted(sum(HALVES.values(), []))


@pytest.mark.slow
@pytest.mark.parametrize("half", sorted(HALVES))
def test_dry_run_writes_every_stage_with_estimates_measurements_and_errors(repo, tmp_path, half):
    script = repo / "benchmarks/gpu_evidence.py"
    out, work = tmp_path / "evidence.json", tmp_path / "work"
    cmd = [sys.executable, str(script), "--dry", "--out", str(out), "--work", str(work)]
    stage_args = [a for s in HALVES[half] for a in ("--stage", s)]
    p = subprocess.run(cmd + stage_args, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert set(doc["stages"]) == set(HALVES[half])
    if "context" in doc["stages"]:
        assert doc["stages"]["context"]["rows"][0]["status"].startswith("skipped: needs CUDA")
    if "sdpa_long" in doc["stages"]:
        assert doc["stages"]["sdpa_long"]["rows"][0]["status"].startswith("skipped: needs CUDA")
    if "trainer_speed" in doc["stages"]:
        _trainer_speed_compares_memfit_with_trl(doc["stages"]["trainer_speed"])
    for name in set(HALVES[half]) - {"context", "sdpa_long", "step_time", "trainer_speed"}:
        ok = [r for r in doc["stages"][name]["rows"] if r["status"] == "ok"]
        assert ok, (name, doc["stages"][name])
        for r in ok:
            e, m, err = r["estimate"], r["measured"], r["error_rel"]
            assert e["peak_allocated_bytes"] > 0 and m["peak_allocated_bytes"] > 0
            assert e["step_time_s"] > 0 and m["step_time_s"] > 0 and m["tokens_per_s"] > 0
            assert err["peak_allocated_bytes"] == round(m["peak_allocated_bytes"] / e["peak_allocated_bytes"] - 1, 4)
            assert err["step_time_s"] == round(m["step_time_s"] / e["step_time_s"] - 1, 4)
            assert m["device_total_bytes"] is None and m["device_total_source"].startswith("skipped: needs CUDA")
            assert e["calibration"] == "uncalibrated (stated heuristics)"
    probes = [r for name, st in doc["stages"].items() if name not in ("step_time", "trainer_speed") for r in st["rows"]]
    assert doc["summary"]["n"] == sum(1 for r in probes if r["status"] == "ok")
    skipped = {r["id"]: r["status"] for st in doc["stages"].values() for r in st["rows"]}
    for cuda_only in (row for row, h in CUDA_ONLY.items() if h == half):
        assert skipped[cuda_only].startswith("skipped: needs CUDA"), skipped[cuda_only]
    if half == "a":
        _calibration_refused_and_stages_resumable(repo, script, cmd, out, doc)
    if "long_context" in doc["stages"]:
        fit_row, over = doc["stages"]["long_context"]["rows"]
        assert fit_row["verdict"] == "ok: fits" and over["candidate"]["seq_len"] == int(fit_row["fit_seq_len"] * 1.1)
    if "step_time" in doc["stages"]:
        _step_time_prices_every_probe(doc, probes)


def _trainer_speed_compares_memfit_with_trl(stage):
    # both runs (LoRA, full) trained memfit's step and TRL's SFTTrainer at the scaled-down Llama-3.1-8B
    # shape, and report each side's tokens/s, MFU and ratio to TRL; Liger's variants say why they did not run
    rows = {r["id"]: r for r in stage["rows"]}
    assert set(rows) == {"trainer-speed-lora", "trainer-speed-full"}
    for finetune, layers in (("lora", 2), ("full", 1)):
        r = rows[f"trainer-speed-{finetune}"]
        assert r["status"] == "ok", r
        report = r["measured"]
        assert report["model_config"][finetune] == {
            "num_hidden_layers": layers,
            "hidden_size": 256,
            "intermediate_size": 896,
            "vocab_size": 8016,
        }
        best = {b["variant"]: b for b in report["best"]}
        assert {"trl", "memfit"} <= set(best) and best["trl"]["vs_trl"] == 1.0
        assert all(b["finetune"] == finetune and b["tokens_per_s"] > 0 and 0 < b["mfu"] for b in best.values())
        ran_liger = {"trl+liger", "memfit+liger"} & set(best)
        assert ran_liger | set(report["skipped"]) == {"trl+liger", "memfit+liger"}
        if importlib.util.find_spec("liger_kernel") is None:
            assert all("liger-kernel" in why for why in report["skipped"].values()), report["skipped"]


def _calibration_refused_and_stages_resumable(repo, script, cmd, out, doc):
    # calibration needs the GPU-only context stage: a dry JSON is refused, nothing written
    cal = subprocess.run([sys.executable, str(script), "--write-calibration", str(out)], capture_output=True, text=True)
    assert cal.returncode != 0 and "context stage has no measurement" in cal.stderr
    assert not (repo / "config/calibration/cpu.json").exists()
    # resumable: a stage already in the JSON is not run again without --force
    again = subprocess.run(cmd + ["--stage", "sft_zero"], capture_output=True, text=True, timeout=300)
    assert (
        "already in" in again.stdout and json.loads(out.read_text())["stages"]["sft_zero"] == doc["stages"]["sft_zero"]
    )


def _step_time_prices_every_probe(doc, probes):
    # memfit's step-time calibration ran once over the probed candidates and priced every probe
    cal, *priced = doc["stages"]["step_time"]["rows"]
    assert cal["status"] == "ok", cal
    measured = {r["id"]: r["measured"]["step_time_s"] for r in probes if r["status"] == "ok"}
    assert {r["id"] for r in priced} == {f"step-time:{i}" for i in measured}
    for r in priced:
        assert r["status"] == "ok" and r["measured_step_time_s"] == measured[r["id"].split(":", 1)[1]]
        assert r["predicted_step_time_s"] == pytest.approx(sum(r["terms_s"].values()), abs=1e-4)
        ratio, p = r["measured_step_time_s"] / r["predicted_step_time_s"], r["predicted_step_time_s"]
        # the JSON rounds the prediction to 1e-5 s and the error to 1e-4: a millisecond prediction
        # moves the ratio by up to ratio x 5e-6 / p
        assert r["step_time_error_rel"] == pytest.approx(ratio - 1, abs=2e-3 + ratio * 5e-6 / p)
    assert cal["summary"]["n"] == len(priced) and cal["summary"]["fastest_measured"] in {r["id"] for r in priced}
