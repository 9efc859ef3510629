"""memfit.workflow.resume_check: a resumed run must continue exactly; and the train stage sets aside
checkpoints of a changed configuration instead of failing on them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from memfit.workflow.resume_check import compare_runs


def run_dir(path: Path, losses: list[float], weight: torch.Tensor) -> Path:
    (path / "model").mkdir(parents=True)
    rows = [{"step": s, "split": "train", "loss": v} for s, v in enumerate(losses, 1)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    save_file({"lm_head.weight": weight}, str(path / "model/model.safetensors"))
    return path


def test_losses_after_the_checkpoint_decide_within_rtol(tmp_path):
    w = torch.randn(4, 8)
    a = run_dir(tmp_path / "a", [3.0, 2.0, 1.0, 0.5], w)
    close = run_dir(tmp_path / "close", [9.0, 2.0, 1.0 + 1e-7, 0.5], w.clone())  # step 1 precedes the resume
    far = run_dir(tmp_path / "far", [3.0, 2.0, 1.1, 0.5], w + 1)
    short = run_dir(tmp_path / "short", [3.0, 2.0, 1.0], w.clone())

    res = compare_runs(a, close, from_step=1, rtol=1e-5)
    assert res["passed"] and res["steps_compared"] == 3 and res["final_step"] == 4
    assert not res["losses_bitwise_equal"] and res["weights_bitwise_equal"]
    res = compare_runs(a, far, from_step=1, rtol=1e-5)
    assert not res["passed"] and res["max_rel_loss_diff"] == pytest.approx(0.1)
    assert res["weights_max_abs_diff"] == pytest.approx(1.0) and not res["weights_bitwise_equal"]
    res = compare_runs(a, short, from_step=1, rtol=1e-5)
    assert not res["passed"] and res["missing_steps"] == [[4, "train"]]


@pytest.mark.slow
def test_verify_resume_and_stale_checkpoints_on_a_real_run(shared_runs, tmp_path):
    """On a copy of the session's ZeRO-2 run (6 steps, checkpoints at 3 and 6; the train stage
    itself, memfit.workflow.pipeline.train, runs in test_fallback_train.py)."""
    import shutil

    from memfit.workflow import pipeline
    from memfit.workflow.resume_check import verify_resume

    src, _ = shared_runs["sft-z2"]
    shutil.copytree(src, tmp_path / "run")
    cfg = dataclasses.replace(shared_runs.config("sft-z2"), out_dir=str(tmp_path / "run"))
    cfg.save(tmp_path / "run.json")
    assert json.loads((tmp_path / "run/summary.json").read_text())["peak_allocated_bytes"] > 0

    res = verify_resume(tmp_path / "run.json", 2, tmp_path / "verify_resume.json", tmp_path / "verify.log")
    assert json.loads((tmp_path / "verify_resume.json").read_text()) == res
    assert res["passed"] and res["losses_bitwise_equal"] and res["weights_bitwise_equal"], res
    # the CPU's kernels repeat: bitwise is expected and required, one resume is enough
    assert (res["expected"], res["tolerance"], res["device"]) == ("bitwise", 0.0, "cpu") and "spread" not in res
    assert (res["from_step"], res["final_step"], res["missing_steps"]) == (3, 6, [])
    assert res["steps_compared"] == 4  # train steps 4, 5, 6 and the evaluation at 6
    assert res["resume_peak_allocated_bytes"] > 0
    assert not (tmp_path / "verify_resume.run/checkpoints").exists()  # the scratch copy's checkpoints go

    ckpts = Path(cfg.out_dir) / "checkpoints"
    pipeline.set_aside_stale_checkpoints(cfg, tmp_path / "train.log")  # the same run: kept, to resume
    assert ckpts.exists()
    changed = dataclasses.replace(cfg, lr=cfg.lr / 2)
    pipeline.set_aside_stale_checkpoints(changed, tmp_path / "train.log")
    assert not ckpts.exists() and (ckpts.parent / "checkpoints.previous").exists()
    assert not (Path(cfg.out_dir) / "metrics.jsonl").exists()
    log = (tmp_path / "train.log").read_text()
    assert "configuration changed" in log and "lr: checkpoint 0.003 != now 0.0015" in log


def test_a_gpu_run_without_deterministic_kernels_is_judged_against_its_own_spread():
    from memfit.train import determinism
    from memfit.workflow.resume_check import within_spread

    assert determinism.expected("cpu", False) == determinism.expected("cuda:0", True) == "bitwise"
    assert determinism.expected("cuda:0", False) == "tolerance"
    resumed = {"missing_steps": [], "max_rel_loss_diff": 3e-3}
    spread = {"max_rel_loss_diff": 1e-3, "weights_max_abs_diff": 2e-4, "losses_bitwise_equal": False}
    verdict = within_spread(resumed, spread, rtol=1e-5)
    assert verdict["passed"] and verdict["tolerance"] == 4e-3 and verdict["spread"] == spread
    # further from the original than two resumes are from each other, by more than the factor: a real divergence
    assert not within_spread({"missing_steps": [], "max_rel_loss_diff": 5e-3}, spread, 1e-5)["passed"]
    # kernels that happened to repeat: never stricter than rtol
    exact = {"max_rel_loss_diff": 0.0, "weights_max_abs_diff": 0.0, "losses_bitwise_equal": True}
    assert within_spread({"missing_steps": [], "max_rel_loss_diff": 5e-6}, exact, 1e-5)["passed"]
    assert not within_spread({"missing_steps": [[9, "train"]], "max_rel_loss_diff": 0.0}, exact, 1e-5)["passed"]


def test_deterministic_mode_turns_on_what_a_gpu_resume_needs():
    import subprocess
    import sys

    code = (
        "import os, torch; from memfit.train import determinism; determinism.enable(); "
        "print(torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(), "
        "torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, os.environ['FLASH_ATTENTION_DETERMINISTIC'], "
        "os.environ.get('CUBLAS_WORKSPACE_CONFIG'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    # strict, not warn_only: warn_only would leave SDPA's flash backward non-deterministic
    assert out == ["True", "False", "True", "False", "1", "None"]
