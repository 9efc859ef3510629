"""Does a resumed run continue exactly where the uninterrupted one went?

`verify_resume` (the workflow's verify_resume stage) resumes a finished run from its
previous checkpoint in a scratch directory and `compare_runs` compares the two: the
per-step losses after the checkpoint (within `rtol`, or within the measured spread of a CUDA
run without deterministic kernels: memfit.train.determinism) and the exported weights.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

from memfit.atomic import write_json_atomic
from memfit.train import checkpoint, determinism
from memfit.train.run_config import RunConfig


def verify_resume(
    run_json: Path, nproc: int, out_json: Path, log: Path, rtol: float = 1e-5, nnodes: int = 1
) -> dict[str, Any]:
    """Resume the finished run from its previous checkpoint and compare with what it did uninterrupted.

    What the comparison may expect (memfit.train.determinism): on the CPU, and on CUDA with
    `train.deterministic`, the resumed run repeats the original bit for bit, and passes when its
    losses and exported weights are bitwise equal to the original's. A CUDA run without
    deterministic kernels repeats neither itself nor its resume exactly: a second resume from the
    same checkpoint measures that spread, and the resumed run passes within SPREAD_FACTOR times
    it (two draws of the same accumulation-order noise; `rtol` at the least)."""
    from memfit.workflow.fallback import effective_run_json

    run = RunConfig.load(effective_run_json(run_json))  # after an OOM fallback: the candidate that finished
    ckpts = Path(run.out_dir) / "checkpoints"
    tags = checkpoint.complete_tags(ckpts)
    if len(tags) < 2:
        raise RuntimeError(
            f"{ckpts} holds {len(tags)} checkpoint(s); verify_resume needs the final one and an earlier one (keep_last >= 2, save_every < steps)"
        )
    tag = tags[-2]
    from_step = int(tag.removeprefix("step"))
    work = _resume(run, ckpts / tag, Path(out_json).parent / "verify_resume.run", nproc, log, nnodes)
    result = compare_runs(Path(run.out_dir), work, from_step, rtol)
    trained = json.loads((Path(run.out_dir) / "summary.json").read_text())
    expect = determinism.expected(trained.get("device", "cpu"), run.deterministic)
    result |= {"expected": expect}
    if expect == determinism.BITWISE:  # what was promised, not only losses within rtol
        result["tolerance"] = 0.0
        result["passed"] = result["passed"] and result["losses_bitwise_equal"] and result["weights_bitwise_equal"]
    else:
        again = _resume(run, ckpts / tag, Path(out_json).parent / "verify_resume.run2", nproc, log, nnodes)
        result |= within_spread(result, compare_runs(work, again, from_step, rtol), rtol)
        shutil.rmtree(again, ignore_errors=True)
    resumed_summary = json.loads((work / "summary.json").read_text())
    result |= {
        "resumed_from": str(ckpts / tag),
        "rtol": rtol,
        "deterministic": run.deterministic,
        "device": trained.get("device"),
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


# how far a resumed run may be from the original, in units of two resumes' own spread: our
# choice, a heuristic (two draws of one noise seldom differ by more than a few times), not a
# figure from a source; a GPU run without deterministic kernels will say whether it holds
SPREAD_FACTOR = 4


def within_spread(result: dict[str, Any], spread: dict[str, Any], rtol: float) -> dict[str, Any]:
    """The verdict on a run whose kernels do not repeat: `result` (original vs resumed) passes
    when its largest relative loss difference is within SPREAD_FACTOR times `spread`'s (two
    resumes from the same checkpoint, compare_runs), and never stricter than `rtol`."""
    tolerance = max(rtol, SPREAD_FACTOR * spread["max_rel_loss_diff"])
    return {
        "tolerance": tolerance,
        "spread": {k: spread[k] for k in ("max_rel_loss_diff", "weights_max_abs_diff", "losses_bitwise_equal")},
        "passed": not result["missing_steps"] and result["max_rel_loss_diff"] <= tolerance,
    }


def _resume(run: RunConfig, ckpt: Path, work: Path, nproc: int, log: Path, nnodes: int) -> Path:
    """Run `run` again from checkpoint `ckpt` into `work` (one checkpoint kept); its directory."""
    from memfit.train.launch import launch

    shutil.rmtree(work, ignore_errors=True)
    resumed = dataclasses.replace(run, out_dir=str(work), resume=str(ckpt), keep_last=1)
    resumed.save(work / "run.json")
    rc = launch(work / "run.json", nproc, log=Path(log), nnodes=nnodes)
    if rc != 0:
        raise RuntimeError(f"resumed run failed (exit code {rc}); see {log}")
    return work


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
