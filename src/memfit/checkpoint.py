"""Checkpoints that are either whole or ignored, and resume from the newest whole one.

Layout under `<run>/checkpoints/`:

    step00000100/            DeepSpeed shards (model, optimizer, scheduler) + memfit files
        rng.rank{r}.pt       per-rank RNG states (Python, NumPy, torch, CUDA where present)
        memfit.json          step, consumed samples, world size, the resolved run config
        COMPLETE             written by rank 0 after every rank finished: the publish mark
    latest                   the newest complete tag (DeepSpeed's own pointer format)

A crash mid-save leaves a directory without COMPLETE; `latest_valid` skips it and
falls back to the previous checkpoint with a warning.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit.atomic import write_json_atomic, write_text_atomic

COMPLETE = "COMPLETE"
# Fields of the run config that must match for a checkpoint to continue the same run.
MUST_MATCH = ("method", "candidate", "seed", "lr", "epochs", "max_steps", "warmup_steps", "min_lr_ratio", "dpo", "data_dir")


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written; the previous one is left as it was."""


def _min_over_ranks(value: float) -> float:
    import torch.distributed as dist

    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return float(t.item())


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def ensure_free_space(root: Path, needed_bytes: int) -> None:
    """Refuse to start a save that cannot finish (every rank decides the same way)."""
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    if _min_over_ranks(free - needed_bytes) < 0:
        raise CheckpointError(
            f"not enough disk for a checkpoint under {root}: {needed_bytes / 2**30:.2f} GiB needed "
            f"(the last checkpoint's size + 10%), {free / 2**30:.2f} GiB free. The previous checkpoint "
            "is intact; free space or lower keep_last, then re-run to resume."
        )


def save(
    engine,
    root: Path,
    step: int,
    client_state: dict[str, Any],
    keep_last: int,
    run_config: dict[str, Any],
    expected_bytes: int = 0,
    metrics: Path | None = None,
) -> Path:
    """Save on every rank, publish on rank 0 once all ranks are done, then rotate.

    Before writing, the free disk is checked against the newest checkpoint's size (or
    `expected_bytes` for the first one) plus 10%. After writing, rank 0 records every file's size
    in memfit.json (the manifest `latest_valid` checks, so a truncated shard is noticed), then the
    COMPLETE mark and the `latest` pointer.
    """
    root = Path(root)
    tag = tag_for(step)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    done = complete_tags(root)
    previous = dir_bytes(root / done[-1]) if done else expected_bytes
    ensure_free_space(root, int(previous * 1.1))
    if _rank() == 0 and (root / tag).exists():
        shutil.rmtree(root / tag)  # a stale copy of this step (a run resumed from an earlier one)
    _barrier()
    engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
    torch.save(rng_state(), root / tag / f"rng.rank{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        if metrics is not None and Path(metrics).exists():
            shutil.copyfile(metrics, root / tag / "metrics.jsonl")  # the curve so far travels with the state
        manifest = {str(p.relative_to(root / tag)): p.stat().st_size for p in sorted((root / tag).rglob("*")) if p.is_file()}
        meta = {"step": step, "world_size": world, "run_config": run_config, "files": manifest, **client_state}
        write_json_atomic(root / tag / "memfit.json", meta)
        write_text_atomic(root / tag / COMPLETE, tag + "\n")
        write_text_atomic(root / "latest", tag)
        for old in complete_tags(root)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(root / old, ignore_errors=True)
    _barrier()
    return root / tag


def complete_tags(root: Path) -> list[str]:
    """Published checkpoints, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and (p / COMPLETE).exists())


def latest_valid(root: Path, log: Callable[[str], None] = print) -> tuple[Path, str] | None:
    """The newest published checkpoint; warns when `latest` points at a broken one."""
    root = Path(root)
    tags = complete_tags(root)
    pointer = root / "latest"
    named = pointer.read_text().strip() if pointer.exists() else None
    if named and named in tags and _looks_whole(root / named):
        return root, named
    for tag in reversed(tags):
        if _looks_whole(root / tag):
            if named:
                log(f"warning: checkpoint {root / named} is incomplete or corrupt; falling back to {root / tag}")
            return root, tag
    if named:
        log(f"warning: no valid checkpoint under {root} ('latest' names {named}); starting fresh")
    return None


def _looks_whole(path: Path) -> bool:
    """Every file the manifest lists is there with its recorded size."""
    try:
        meta = json.loads((path / "memfit.json").read_text())
    except (OSError, ValueError):
        return False
    for rel, size in meta.get("files", {}).items():
        f = path / rel
        if not f.is_file() or f.stat().st_size != size:
            return False
    world = int(meta.get("world_size", 1))
    return all((path / f"rng.rank{r}.pt").exists() for r in range(world))


def check_compatible(meta: dict[str, Any], run_config: dict[str, Any], where: Path, world: int | None = None) -> None:
    """Raise ValueError naming each difference when `meta`'s run is not `run_config`'s."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if world is None else world
    diffs = [
        f"{k}: checkpoint {meta['run_config'].get(k)!r} != now {run_config.get(k)!r}"
        for k in MUST_MATCH
        if meta["run_config"].get(k) != run_config.get(k)
    ]
    if int(meta["world_size"]) != world:
        diffs.append(f"world size: checkpoint {meta['world_size']} != now {world}")
    if diffs:
        raise ValueError(
            f"checkpoint {where} belongs to a different run and was not loaded:\n  "
            + "\n  ".join(diffs)
            + "\nDelete it (or the run directory) to start fresh."
        )


def load(engine, root: Path, tag: str, run_config: dict[str, Any]) -> dict[str, Any]:
    """Refuse a checkpoint of another run, then load shards, scheduler and RNG states."""
    root = Path(root)
    meta = json.loads((root / tag / "memfit.json").read_text())
    check_compatible(meta, run_config, root / tag)
    path, _client = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {root / tag}")
    set_rng_state(torch.load(root / tag / f"rng.rank{_rank()}.pt", weights_only=False))
    # free what loading left behind before the first step, so resume peaks no higher than training
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return meta


def restore_metrics(path: Path, step: int, checkpoint_dir: Path) -> None:
    """The metrics of a resumed run: the copy saved with the checkpoint (rows up to `step`), else
    the live file's rows up to `step`; a line torn by a kill is dropped."""
    path = Path(path)
    saved = Path(checkpoint_dir) / "metrics.jsonl"
    src = saved if saved.exists() else path
    if not src.exists():
        return
    rows = []
    for line in src.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                rows.append(line)
        except (ValueError, KeyError):
            continue
    write_text_atomic(path, "".join(r + "\n" for r in rows))
