"""Training survives a wrong choice: after an OOM, continue with the next candidate that fits.

`memfit.workflow.pipeline.train` launches the selected run (run.json). When it ends with a device OOM (a
rank's `oom.rank<r>.json` marker, written by `memfit.train.rank.run_rank`), it picks the next candidate of
selected.json's ranking (`next_candidate`) that

- fits (its verdict in selected.json),
- keeps the training dynamics: only the levers of `checkpoint_compat.LEVERS` differ from the selected
  candidate (ZeRO stage, offload, pin memory, gradient checkpointing, micro batch / grad_accum,
  DPO reference mode, loss_impl full<->chunked, which changes float rounding only), and the
  global batch (micro batch x grad_accum x ranks) is the same, so the data order is too,
- can continue the newest complete checkpoint (`checkpoint.check_compatible` with the
  fallback's levers: the same ZeRO stage and offload as saved, or another ZeRO-1/2/3 stage or
  offload through a universal checkpoint, except ZeRO-3 to ZeRO-1/2; ZeRO-0 <-> ZeRO-n has no
  conversion; without a checkpoint any stage may take over),
- and was not judged to need at least as much device memory as the candidate that ran out
  (it would run out too),

writes its run config as `train/run.fallback-<n>.json` (RunConfig `fallback: n`), records the
switch in `train/fallbacks.json`, and launches again; the run resumes from the newest complete
checkpoint, and `metrics.jsonl` continues from that checkpoint's step (rows after it are dropped
as on any resume). No candidate left: a RuntimeError naming what was tried and why every other
candidate was refused. The records end up in `train/summary.json` as `fallbacks`.

Why in the job rather than Snakemake's `attempt`: run.json is `select_config`'s output, an input
of `train` that a retry cannot change, and `restart-times` already resubmits preempted jobs
(which must resume with the same candidate).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from memfit.atomic import write_json_atomic
from memfit.space import Candidate
from memfit.train import checkpoint, checkpoint_compat

STATE = "fallbacks.json"  # in the train directory: {"base": run.json's content, "fallbacks": [records]}
OOM_MARKERS = "oom.rank*.json"


def _full(cand: dict[str, Any]) -> dict[str, Any]:
    return Candidate.from_dict(cand).to_dict()


def global_batch(cand: dict[str, Any], world: int) -> int:
    return Candidate.from_dict(cand).global_batch(world)


def dynamics_problems(base: dict[str, Any], cand: dict[str, Any], world: int) -> list[str]:
    """Why `cand` would not train what `base` trains (empty: only levers differ, same global batch)."""
    a, b = _full(base), _full(cand)
    out = [
        f"{k} {a[k]!r} -> {b[k]!r} changes what is learned"
        for k in a
        if k not in checkpoint_compat.LEVERS and a[k] != b[k]
    ]
    gb_a, gb_b = global_batch(a, world), global_batch(b, world)
    if gb_a != gb_b:
        out.append(f"global batch {gb_a} -> {gb_b} (micro_batch x grad_accum x {world} ranks) changes the data order")
    return out


def resume_problem(writer: dict[str, Any] | None, cand: dict[str, Any], world: int) -> str | None:
    """Why `cand` cannot continue a checkpoint written by candidate `writer` (None: it can, or
    there is no checkpoint), as `checkpoint.check_compatible` decides it for a fallback."""
    if writer is None:
        return None
    meta = {"world_size": world, "run_config": {"candidate": writer}}
    try:
        checkpoint.check_compatible(
            meta, {"candidate": cand, "fallback": 1}, Path("the newest checkpoint"), world=world
        )
    except ValueError as e:
        return " ".join(str(e).split())
    return None


def next_candidate(
    ranking: list[dict[str, Any]],
    base: dict[str, Any],
    failed: dict[str, Any],
    writer: dict[str, Any] | None,
    tried: list[str],
    world: int,
) -> tuple[dict[str, Any] | None, list[str]]:
    """The first row of selected.json's `candidates` (best first) to fall back to, and why each
    fitting row before it was refused.

    `base` is the selected candidate (run.json), `failed` the one that just ran out of memory,
    `writer` the candidate that wrote the newest complete checkpoint (None: no checkpoint, the
    fallback starts fresh), `tried` the ids already run.
    """
    failed_id = Candidate.from_dict(failed).id
    failed_row = next((r for r in ranking if r.get("id") == failed_id), None)
    failed_bytes = failed_row.get("device_bytes") if failed_row else None
    refused: list[str] = []
    for row in ranking:
        cid = row["id"]
        if cid in tried or cid == failed_id or not row.get("fits"):
            continue
        why = dynamics_problems(base, row["candidate"], world)
        if not why:
            problem = resume_problem(writer, row["candidate"], world)
            if problem:
                why.append(problem)
        if not why and failed_bytes and row.get("device_bytes") and row["device_bytes"] >= failed_bytes:
            why.append(
                f"judged to need {row['device_bytes']} B ({row.get('source')}), not less than the "
                f"{failed_bytes} B of {failed_id}, which ran out of memory"
            )
        if why:
            refused.append(f"{cid}: " + "; ".join(why))
            continue
        return row, refused
    return None, refused


def load_ranking(selected_json: Path) -> list[dict[str, Any]]:
    """selected.json's `candidates` (every candidate with its verdict, best first)."""
    from memfit.estimate.rows import Selection

    path = Path(selected_json)
    if not path.exists():
        raise FileNotFoundError(f"{path}: missing; the OOM fallback needs select_config's ranking beside run.json")
    sel = Selection.from_json(json.loads(path.read_text()), str(path))
    return [r.to_json() for r in sel.candidates]


# --------------------------------------------------------------------------- state in the train directory
def fallback_config_path(out_dir: str | Path, n: int) -> Path:
    return Path(out_dir) / f"run.fallback-{n}.json"


def load_state(base: Any) -> list[dict[str, Any]]:
    """The fallbacks recorded for this run (RunConfig `base`, i.e. run.json). Records of another
    run.json (the selection changed since) are stale: they and their run configs are removed."""
    out = Path(base.out_dir)
    path = out / STATE
    if not path.exists():
        return []
    try:
        state = json.loads(path.read_text())
        if state["base"] == dataclasses.asdict(base):
            records = list(state["fallbacks"])
            if all(fallback_config_path(out, n + 1).exists() for n in range(len(records))):
                return records
    except (ValueError, KeyError, TypeError):
        pass
    path.unlink()
    for p in out.glob("run.fallback-*.json"):
        p.unlink()
    return []


def clear_state(out_dir: str | Path) -> None:
    """Forget the fallbacks of a run that was set aside (its checkpoints belong to other inputs)."""
    out = Path(out_dir)
    (out / STATE).unlink(missing_ok=True)
    for p in out.glob("run.fallback-*.json"):
        p.unlink()


def save_state(base: Any, records: list[dict[str, Any]]) -> None:
    write_json_atomic(Path(base.out_dir) / STATE, {"base": dataclasses.asdict(base), "fallbacks": records})


def effective_run_json(run_json: str | Path) -> Path:
    """The run config the run in run.json's directory last trained with: run.json, or after OOM
    fallbacks the newest `train/run.fallback-<n>.json` (what verify_resume must resume with); the
    copy with the content digests the train stage launched (`<out_dir>/run.resolved.json`,
    memfit.train.identity) where it is that config's, so the resume continues the same inputs."""
    from memfit.train.identity import resolved_path
    from memfit.train.run_config import RunConfig

    base = RunConfig.load(run_json)
    records = load_state(base)
    path = fallback_config_path(base.out_dir, len(records)) if records else Path(run_json)
    resolved = resolved_path(path, base.out_dir)
    if resolved != path and resolved.exists():
        try:
            copy = RunConfig.load(resolved)
        except (ValueError, TypeError):
            return path
        if dataclasses.replace(copy, inputs={}) == dataclasses.replace(RunConfig.load(path), inputs={}):
            return resolved
    return path


def oom_markers(out_dir: str | Path) -> list[dict[str, Any]]:
    """The OOM markers the ranks of the last launch wrote (lowest rank first)."""
    out = []
    for p in sorted(Path(out_dir).glob(OOM_MARKERS)):
        try:
            out.append(json.loads(p.read_text()))
        except ValueError:
            continue
    return sorted(out, key=lambda m: m.get("rank", 0))


def clear_oom_markers(out_dir: str | Path) -> None:
    for p in Path(out_dir).glob(OOM_MARKERS):
        p.unlink()


def record(marker: dict[str, Any], resumed_from_step: int, from_id: str, to_id: str) -> dict[str, Any]:
    """One entry of summary.json's `fallbacks`."""
    return {
        "oom_step": int(marker.get("step") or 0),
        "resumed_from_step": int(resumed_from_step),
        "from": from_id,
        "to": to_id,
        "phase": str(marker.get("phase", "unknown")),
        "op": marker.get("op"),
        "bytes_live": int(marker.get("live_bytes") or 0),
        "capacity_bytes": int(marker.get("capacity_bytes") or 0),
    }
