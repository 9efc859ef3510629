"""The train stage: launch run.json's run with the content digests of what it starts from
(memfit.train.identity), set aside the checkpoints of another run, and after a device OOM continue
with the next candidate (memfit.workflow.fallback). `memfit.workflow.pipeline` re-exports `train`."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from memfit.atomic import write_json_atomic
from memfit.train import checkpoint, identity
from memfit.train.run_config import RunConfig


def with_inputs(path: Path, inputs: dict[str, str]) -> tuple[RunConfig, Path]:
    """The run config at `path` with `inputs`, and the file the ranks read: `path` itself when it
    records them already (a fallback config memfit wrote), else a copy in the run's out_dir
    (identity.resolved_path): run.json is select_config's output, never rewritten."""
    cfg = RunConfig.load(path)
    if cfg.inputs == inputs:
        return cfg, Path(path)
    now = dataclasses.replace(cfg, inputs=inputs)
    dest = identity.resolved_path(Path(path), cfg.out_dir)
    now.save(dest)
    return now, dest


def train(run_json: Path, nproc: int, log: Path, nnodes: int = 1, selected_json: Path | None = None) -> dict[str, Any]:
    """Train run.json's candidate; after a device OOM fall back to the next candidate of
    selected.json's ranking that keeps the training dynamics, from the newest complete
    checkpoint (memfit.workflow.fallback), until the run completes or no candidate is left.

    Writes train/summary.json with `fallbacks`: one record per switch (empty without any)."""
    from memfit.train.launch import launch
    from memfit.workflow import fallback

    run_json, log = Path(run_json), Path(log)
    base = RunConfig.load(run_json)
    try:  # what the run starts from, by content: once, before any rank starts
        inputs = identity.run_inputs(base)
    except identity.InputError as e:
        raise identity.InputError(f"{run_json}: {e}") from None
    records = fallback.load_state(base)  # a re-run after a crash continues with the last fallback
    path = fallback.fallback_config_path(base.out_dir, len(records)) if records else run_json
    run, run_path = with_inputs(path, inputs)
    if set_aside_stale_checkpoints(run, log) and records:
        # the fallbacks recorded belong to the run whose checkpoints went aside: start from run.json
        fallback.clear_state(base.out_dir)
        records = []
        run, run_path = with_inputs(run_json, inputs)
    out = Path(run.out_dir)
    ranking: list[dict[str, Any]] | None = None
    while True:
        fallback.clear_oom_markers(out)
        rc = launch(run_path, nproc, log=log, nnodes=nnodes)
        if rc == 0:
            break
        markers = fallback.oom_markers(out)
        if not markers:
            raise RuntimeError(
                f"training failed (exit code {rc}); see {log}. Re-running resumes from the newest checkpoint."
            )
        if ranking is None:
            ranking = fallback.load_ranking(
                Path(selected_json) if selected_json else run_json.with_name("selected.json")
            )
        record, run = _fall_back(base, run, records, markers[0], ranking, nproc * nnodes, log)
        records.append(record)
        run_path = fallback.fallback_config_path(out, len(records))
        run.save(run_path)
        fallback.save_state(base, records)  # after the run config it names: a re-run finds both
    fallback.clear_oom_markers(out)
    summary = json.loads((out / "summary.json").read_text())
    summary["fallbacks"] = records
    summary["trained_candidate"] = run.cand.id
    write_json_atomic(out / "summary.json", summary)
    return summary


def _fall_back(
    base: RunConfig,
    run: RunConfig,
    records: list[dict[str, Any]],
    marker: dict[str, Any],
    ranking: list[dict[str, Any]],
    world: int,
    log: Path,
) -> tuple[dict[str, Any], RunConfig]:
    """After `run` ran out of device memory: the fallback record and the next run config, or a
    RuntimeError naming every candidate tried and why the others were refused."""
    from memfit.workflow import fallback

    ckpts = Path(run.out_dir) / "checkpoints"
    checkpoint.remove_incomplete(ckpts, log=lambda msg: _say(log, msg))  # a save the OOM cut short
    found = checkpoint.latest_valid(ckpts, log=lambda msg: _say(log, msg))
    writer, step = None, 0
    if found is not None:
        meta = json.loads((found[0] / found[1] / "memfit.json").read_text())
        writer, step = meta["run_config"]["candidate"], int(meta["step"])
    tried = [base.cand.id] + [r["to"] for r in records]
    where = f"at step {marker.get('step')} ({marker.get('phase', 'unknown phase')}"
    if marker.get("live_bytes") and marker.get("capacity_bytes"):
        where += f", {marker['live_bytes']} B live > {marker['capacity_bytes']} B"
    where += ")"
    row, refused = fallback.next_candidate(ranking, base.candidate, run.candidate, writer, tried, world)
    if row is None:
        raise RuntimeError(
            f"training ran out of device memory with {run.cand.id} {where}, and no candidate is left to fall back to.\n"
            f"Tried: {', '.join(tried)}.\nRefused (fitting candidates of selected.json):\n  "
            + ("\n  ".join(refused) or "none")
            + f"\nSee {log}. Raise the budget's headroom (or widen the search space) and re-run select_config."
        )
    rec = fallback.record(marker, step, run.cand.id, row["id"])
    nxt = dataclasses.replace(base, candidate=row["candidate"], fallback=len(records) + 1, inputs=run.inputs)
    msg = (
        f"memfit: OOM fallback {len(records) + 1}: {run.cand.id} ran out of device memory {where}; "
        f"continuing with {row['id']} from {'step ' + str(step) if found else 'the start (no checkpoint yet)'}"
    )
    _say(log, msg)
    print(msg, file=sys.__stderr__, flush=True)  # the console, also when stderr goes to the rule's log
    return rec, nxt


def _say(log: Path, msg: str) -> None:
    with open(log, "a") as f:
        f.write(msg + "\n")


def set_aside_stale_checkpoints(run: RunConfig, log: Path) -> bool:
    """Checkpoints of another run cannot continue this one: Snakemake re-runs `train` when the
    selected configuration changed, and a DPO run when the SFT model it starts from was trained
    again (another content, maybe the same path: checkpoint_compat compares `inputs`). They move to
    `checkpoints.previous` (replacing an older one) with the reason in the log and on the console,
    instead of blocking the run or, worse, being resumed; a crash of the same run resumes.
    True when they were moved."""
    ckpts = Path(run.out_dir) / "checkpoints"
    found = checkpoint.latest_valid(ckpts, log=lambda _msg: None)
    if found is None:
        return False
    meta = json.loads((found[0] / found[1] / "memfit.json").read_text())
    try:
        checkpoint.check_compatible(meta, dataclasses.asdict(run), found[0] / found[1], world=int(meta["world_size"]))
        return False
    except ValueError as e:
        reason = str(e).splitlines()[1:-1]
    dest = ckpts.with_name("checkpoints.previous")
    shutil.rmtree(dest, ignore_errors=True)
    ckpts.rename(dest)
    (Path(run.out_dir) / "metrics.jsonl").unlink(missing_ok=True)
    msg = f"configuration changed; moved old checkpoints to {dest}:\n" + "\n".join(reason) + "\n"
    with open(log, "a") as f:
        f.write(msg)
    if sys.__stderr__ is not None:  # the console, also when stderr goes to the rule's log
        sys.__stderr__.write("memfit: " + msg)
        sys.__stderr__.flush()
    return True
