"""Does a resumed run continue exactly where the uninterrupted one went?

`verify_resume` (the workflow's verify_resume stage) resumes a finished run from its
previous checkpoint in a scratch directory and `compare_runs` compares the two: the
per-step losses after the checkpoint (within `rtol`) and the exported weights.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

from memfit.atomic import write_json_atomic
from memfit.train import checkpoint
from memfit.train.run_config import RunConfig


def verify_resume(
    run_json: Path, nproc: int, out_json: Path, log: Path, rtol: float = 1e-5, nnodes: int = 1
) -> dict[str, Any]:
    """Resume the finished run from its previous checkpoint and compare with what it did uninterrupted."""
    from memfit.train.launch import launch
    from memfit.workflow.fallback import effective_run_json

    run = RunConfig.load(effective_run_json(run_json))  # after an OOM fallback: the candidate that finished
    ckpts = Path(run.out_dir) / "checkpoints"
    tags = checkpoint.complete_tags(ckpts)
    if len(tags) < 2:
        raise RuntimeError(
            f"{ckpts} holds {len(tags)} checkpoint(s); verify_resume needs the final one and an earlier one (keep_last >= 2, save_every < steps)"
        )
    tag = tags[-2]
    work = Path(out_json).parent / "verify_resume.run"
    shutil.rmtree(work, ignore_errors=True)
    resumed = dataclasses.replace(run, out_dir=str(work), resume=str(ckpts / tag), keep_last=1)
    resumed.save(work / "run.json")
    rc = launch(work / "run.json", nproc, log=Path(log), nnodes=nnodes)
    if rc != 0:
        raise RuntimeError(f"resumed run failed (exit code {rc}); see {log}")
    result = compare_runs(Path(run.out_dir), work, int(tag.removeprefix("step")), rtol)
    trained = json.loads((Path(run.out_dir) / "summary.json").read_text())
    resumed_summary = json.loads((work / "summary.json").read_text())
    result |= {
        "resumed_from": str(ckpts / tag),
        "rtol": rtol,
        # resume is where runs die a second time: its peak beside the uninterrupted training peak
        "training_peak_allocated_bytes": trained["peak_allocated_bytes"],
        "resume_peak_allocated_bytes": resumed_summary.get("resume_peak_allocated_bytes"),
        "resume_host_rss_bytes": resumed_summary.get("resume_host_rss_bytes"),
        "training_host_rss_bytes": trained.get("host_rss_bytes_max_rank"),
        "memory_source": trained.get("memory_source"),
    }
    write_json_atomic(out_json, result)
    shutil.rmtree(work / "checkpoints", ignore_errors=True)
    return result


def compare_runs(original: Path, resumed: Path, from_step: int, rtol: float) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    def rows(d: Path) -> dict[tuple[int, str], dict[str, Any]]:
        out = {}
        for line in (d / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            out[(r["step"], r["split"])] = r
        return out

    a, b = rows(original), rows(resumed)
    keys = sorted(k for k in a if k[0] > from_step)
    missing = [k for k in keys if k not in b]
    diffs = [abs(a[k]["loss"] - b[k]["loss"]) / max(abs(a[k]["loss"]), 1e-12) for k in keys if k in b]
    # the exported weights: the model, or the adapter only (train.<method>.export: adapter)
    name = (
        "adapter_model.safetensors"
        if (original / "model" / "adapter_model.safetensors").exists()
        else "model.safetensors"
    )
    wa = load_file(str(original / "model" / name))
    wb = load_file(str(resumed / "model" / name))
    wdiff = max(float((wa[n].float() - wb[n].float()).abs().max()) for n in wa)
    bitwise = all(torch.equal(wa[n], wb[n]) for n in wa)
    max_rel = max(diffs, default=0.0)
    return {
        "from_step": from_step,
        "final_step": max(k[0] for k in a),
        "steps_compared": len(keys),
        "missing_steps": [list(k) for k in missing],
        "max_rel_loss_diff": max_rel,
        "losses_bitwise_equal": all(a[k]["loss"] == b[k]["loss"] for k in keys if k in b),
        "weights_max_abs_diff": wdiff,
        "weights_bitwise_equal": bitwise,
        "passed": not missing and max_rel <= rtol,
    }
