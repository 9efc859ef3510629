"""The training loop's checkpoint hooks: which checkpoint a run resumes from (refused when it is
another run's), loading it (host RAM checked first; a universal checkpoint across world sizes or
ZeRO stages), and saving one. `Run.setup`, `Run.maybe_resume` and `Run.save` call these; the
checkpoint format itself is memfit.train.checkpoint. `run` is always the `memfit.train.loop.Run` at hand
(not imported here: the loop imports these hooks)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from memfit.train import checkpoint, checkpoint_digest, resume_ram
from memfit.train.modeling import DTYPE
from memfit.units import gib


def save(run, step: int) -> None:
    """Checkpoint `step` (memfit.train.checkpoint.save: whole or ignored, rotated, space checked first)."""
    run._phase("checkpoint save")
    checkpoint.save(
        run.engine,
        run.ckpt_root,
        step,
        client_state={"step": step, "consumed_samples": step * run.schedule.global_batch},
        keep_last=run.cfg.keep_last,
        run_config=dataclasses.asdict(run.cfg),
        expected_bytes=checkpoint_bytes(run),
        metrics=run.metrics_path,
    )


def checkpoint_bytes(run) -> int:
    """What the first checkpoint writes: 16-bit (or fp32) weights plus fp32 master weights and
    two Adam moments for the trainable ones (12 bytes/param, ZeRO paper Sec. 3.1)."""
    params = list(run.engine.module.parameters())
    total = sum(getattr(p, "ds_numel", p.numel()) for p in params)
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in params if p.requires_grad)
    return total * DTYPE[run.cand.precision].itemsize + trainable * 12


def plan_resume(run) -> tuple[Path, str, str] | None:
    """(checkpoint root, tag, how it loads: checkpoint.SAME/DIRECT/UNIVERSAL_LOAD) or None for
    a fresh start. `resume: auto` takes the newest checkpoint whose manifest, step (within the
    run's `total_steps`) and every file's SHA-256 check out, passing over the others with a
    warning; an explicit `resume: <path>` that fails them is refused. Raises when the checkpoint
    is another run's or cannot follow this world size."""
    cfg = run.cfg
    if cfg.resume == "never":
        return None
    if cfg.resume == "auto":
        found = checkpoint.latest_valid(run.ckpt_root, log=run.log, digests=True, max_step=run.total_steps)
        if found is None:
            return None
        root, tag = found
    else:
        p = Path(cfg.resume)
        root, tag = p.parent, p.name
        _meta, problem = checkpoint_digest.verify(p, max_step=run.total_steps)
        if problem is not None:
            raise checkpoint.CheckpointError(
                f"resume: {p} cannot be resumed from: {problem}. Nothing was loaded; name another "
                "checkpoint, or `resume: auto` to take the newest sound one."
            )
    meta = json.loads((root / tag / "memfit.json").read_text())
    run.step_now = int(meta["step"])  # an OOM while loading it is recorded at its step
    return root, tag, checkpoint.check_compatible(meta, dataclasses.asdict(cfg), root / tag, world=run.world)


def load_planned(run) -> int:
    """Load the checkpoint `plan_resume` chose (host RAM checked first; a universal one converted
    once): the step it holds, or 0 for a fresh start (which drops a dead run's metrics)."""
    cfg = run.cfg
    if run.resume_plan is None:
        if cfg.resume == "auto" and run.rank == 0 and run.metrics_path.exists():
            run.metrics_path.unlink()  # a fresh start must not append to a dead run's curve
        return 0
    root, tag, mode = run.resume_plan
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", run.world))
    if mode == checkpoint.UNIVERSAL_LOAD:
        need = resume_ram.resume_host_bytes(root, tag, mode)
        if "convert" in need:  # rank 0 alone converts; the node's other ranks only wait
            resume_ram.ensure_host_ram(need["convert"], root / tag, "converting it to a universal checkpoint")
        checkpoint.ensure_universal(root, tag, log=run.log)
        checkpoint.universal_for_stage(root, tag, run.cand.zero)  # an OOM fallback to another ZeRO stage
    need = resume_ram.resume_host_bytes(root, tag, mode, checkpoint.checkpoint_loader())
    resume_ram.ensure_host_ram(
        ranks_here * need["per_rank"],
        root / tag,
        f"loading it ({ranks_here} ranks x {gib(need['per_rank'])} read to the CPU per rank)",
    )
    state = checkpoint.load(run.engine, root, tag, run_config=dataclasses.asdict(cfg), mode=mode, seed=cfg.seed)
    step = int(state["step"])
    if run.rank == 0:
        checkpoint.restore_metrics(run.metrics_path, step, root / tag)
    how = ""
    z_then = int(state["run_config"]["candidate"].get("zero", run.cand.zero))
    if mode != checkpoint.SAME and int(state["world_size"]) == run.world:  # an OOM fallback changed the stage
        how = (
            f" (written with ZeRO-{z_then}, now ZeRO-{run.cand.zero}: universal checkpoint, "
            "RNG reseeded from (seed, step, rank))"
        )
    elif mode != checkpoint.SAME:
        how = (
            f" (written by {state['world_size']} ranks, now {run.world}: "
            f"{'universal checkpoint' if mode == checkpoint.UNIVERSAL_LOAD else 'unpartitioned state'}, "
            "RNG reseeded from (seed, step, rank))"
        )
    run.log(f"resumed from {root / tag} at step {step}{how}")
    return step
