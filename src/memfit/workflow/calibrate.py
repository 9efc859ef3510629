"""The calibrate stage: what a training step costs on this machine (memfit.train.calibrate runs
on every rank), measured once per model and GPU type before the candidates are estimated, so
that their step times (memfit.estimate.time.timing) are this machine's and not a model's."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from memfit.estimate.models import catalog
from memfit.estimate.time import timing
from memfit.train.launch import launch
from memfit.workflow.config import WorkflowConfig


class CalibrationFailed(RuntimeError):
    """The calibration ranks did not finish: the log's tail says why."""


def spec(cfg: WorkflowConfig, model: str, out_json: Path, work_dir: Path, reps: int = 5) -> dict[str, Any]:
    """The calibration spec (memfit.train.calibrate.Spec) of `model`: every candidate of every
    method of the search space, the run settings that change a step (LoRA, DPO, loss). Where a
    candidate offloads its optimizer, the ranks also measure DeepSpeedCPUAdam (`cpu_adam`)."""
    model_path = cfg.model_path(model)
    cands = {m: cfg.candidates(m) for m in cfg.methods}
    # the settings of a run (train: section), read from the first candidate's run config
    m0 = next(iter(cands))
    run = cfg.run_config(m0, cands[m0][0].to_dict(), str(model_path), "-", "-")
    runs = {m: cfg.run_config(m, cs[0].to_dict(), str(model_path), "-", "-") for m, cs in cands.items()}
    return {
        "model_path": str(model_path),
        "out": str(out_json),
        "work_dir": str(work_dir),
        "candidates": {m: [c.to_dict() for c in cs] for m, cs in cands.items()},
        "lora": {"alpha": run.lora_alpha, "dropout": run.lora_dropout, "targets": run.lora_targets},
        "qlora_quant_type": run.qlora_quant_type,
        "dpo": runs["dpo"].dpo if "dpo" in runs else {},
        "pref": {m: r.pref for m, r in runs.items() if r.pref},
        "loss_on": run.loss_on,
        "loss_chunk_tokens": run.loss_chunk_tokens,
        "mlp_tile_tokens": run.mlp_tile_tokens,
        "deterministic": run.deterministic,
        "reps": reps,
        # what the figures are of, as the estimator of this model sees it (it refuses another shape)
        "model": timing.model_identity(catalog.model(cfg.arch_source(model), allow_moe=True)),
    }


def calibrate(
    cfg: WorkflowConfig | dict[str, Any],
    model: str,
    out_json: Path,
    log: Path,
    timeout_s: float = 1800,
    gpu: str | None = None,
) -> dict[str, Any]:
    """Run the calibration on `cfg.num_gpus` ranks of this node; write and return calibration.json.
    With `gpu` (the `{gpu}` it is for), a GPU this machine lacks stops it before any rank starts."""
    from memfit.workflow.pipeline import check_model
    from memfit.workflow.probe import require_target_device

    cfg = WorkflowConfig.of(cfg)
    if gpu is not None:
        require_target_device(gpu, cfg.plan_only, "calibrate")
    check_model(cfg, model)  # a broken model directory named before the ranks start
    out_json = Path(out_json)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="calibrate-", dir=out_json.parent))
    try:
        spec_path = work / "spec.json"
        spec_path.write_text(json.dumps(spec(cfg, model, out_json, work / "models"), indent=1))
        try:
            rc = launch(spec_path, cfg.num_gpus, log=Path(log), timeout_s=timeout_s, rank_command="calibrate")
        except subprocess.TimeoutExpired:
            raise CalibrationFailed(
                f"calibration of {model} did not finish within {timeout_s:.0f} s; see {log}"
            ) from None
        if rc != 0 or not out_json.exists():
            tail = "\n".join(Path(log).read_text(errors="replace").splitlines()[-25:]) if Path(log).exists() else ""
            out_json.unlink(missing_ok=True)
            raise CalibrationFailed(f"calibration of {model} failed (exit {rc}); the end of {log}:\n{tail}")
        return json.loads(out_json.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
