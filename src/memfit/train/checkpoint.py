"""Checkpoints that are either whole or ignored, and resume from the newest whole one.

Layout under `<run>/checkpoints/`:

    step00000100/            DeepSpeed shards (model, optimizer, scheduler) + memfit files
        rng.rank{r}.pt       per-rank RNG states (Python, NumPy, torch, CUDA where present) as
                             tensors and numbers only, read back with weights_only=True
        memfit.json          step, consumed samples, world size, the resolved run config, and
                             `files`: every other file's size and SHA-256
        COMPLETE             written by rank 0 after every rank finished: the publish mark, with
                             the SHA-256 of memfit.json
    latest                   the newest complete tag (DeepSpeed's own pointer format)
    universal/step00000100/  DeepSpeed universal checkpoint converted from step00000100, made
                             once when a run resumes on a different number of ranks

A crash mid-save leaves a directory without COMPLETE; `latest_valid` skips it, and one whose
manifest or any file's digest does not match (memfit.train.checkpoint_digest), and falls back to
the previous checkpoint with a warning naming the file. `load` verifies again right before it
reads anything (a file hashed and unchanged since, by inode, size, mtime and ctime, is not hashed
twice), loads every file with weights_only=True, and checks DeepSpeed's restored step.

Resuming on a different number of ranks (`resume_mode`): ZeRO-1/2/3 partition the optimizer
state (and at stage 3 the weights) by data-parallel rank, and DeepSpeed's ordinary load refuses
a different DP world size (runtime/engine.py `_load_zero_checkpoint`: "Automatic adjustment of
ZeRO's optimizer state partitioning with a new world size is not currently supported"). Such a
checkpoint is converted once with DeepSpeed's `ds_to_universal` (rank 0, into a temporary
directory renamed into place) and loaded with `checkpoint.load_universal` (DeepSpeed's
universal checkpointing, https://www.deepspeed.ai/tutorials/universal-checkpointing/). ZeRO-0
keeps whole replicas, so its checkpoint loads as is on any number of ranks. Per-rank RNG
states do not map to another world: the resumed ranks are reseeded from (seed, step, rank).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from memfit.atomic import write_json_atomic, write_text_atomic
from memfit.train import dist as dist_env
from memfit.train.adam_steps import replay_adam_steps
from memfit.train.adapter_state import adapter_only_state_dict, load_adapter_state
from memfit.train.checkpoint_compat import SAME, UNIVERSAL_LOAD, check_compatible
from memfit.train.checkpoint_digest import (  # COMPLETE, CheckpointError: also known as checkpoint.*
    COMPLETE,
    MANIFEST,
    CheckpointError,  # noqa: F401
    complete_text,
    file_entries,
    hash_files,
    load_weights_only,
    manifest_problem,
    rng_problem,
    safe_loads,
    sha256_file,
    verify,
    verify_files,
    world_agrees,
)
from memfit.train.optimizer_load import base_optimizer, in_place_loading
from memfit.train.rng_files import load_rng_state, reseed, rng_state, set_rng_state  # noqa: F401
from memfit.train.stream_load import own_memory, streamed_loading
from memfit.units import gib

UNIVERSAL = "universal"  # sibling directory of converted (universal) checkpoints
# in a conversion: the SHA-256 of the source checkpoint's memfit.json and the conversion's `files`
UNIVERSAL_SOURCE = "memfit_source.json"
# MEMFIT_CHECKPOINT_LOADER=deepspeed: load as DeepSpeed alone does (files read whole, the optimizer
# state through torch's load_state_dict): the baseline benchmarks/bench_resume_memory.py measures
# memfit's loader against, and a way back should a DeepSpeed release change its load path
LOADER_ENV = "MEMFIT_CHECKPOINT_LOADER"


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def ensure_free_space(root: Path, needed_bytes: int) -> None:
    """Refuse to start a save that cannot finish (every rank decides the same way)."""
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    if dist_env.min_over_ranks(free - needed_bytes) < 0:
        raise CheckpointError(
            f"not enough disk for a checkpoint under {root}: {gib(needed_bytes)} needed "
            f"(the last checkpoint's size + 10%), {gib(free)} free. The previous checkpoint "
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
    `expected_bytes` for the first one) plus 10%. After writing, the ranks hash the files together
    and rank 0 records every file's size and SHA-256 in memfit.json (the manifest `latest_valid`
    and `load` check), then the COMPLETE mark with memfit.json's SHA-256 and the `latest` pointer.
    Published checkpoints of later steps (a timeline this run left when it resumed from an
    earlier checkpoint) are removed, and the oldest beyond `keep_last`.
    """
    root = Path(root)
    tag = tag_for(step)
    world = dist_env.world()
    done = complete_tags(root)
    previous = dir_bytes(root / done[-1]) if done else expected_bytes
    ensure_free_space(root, int(previous * 1.1))
    if dist_env.rank() == 0:
        if (root / tag).exists():
            shutil.rmtree(root / tag)  # a stale copy of this step (a run resumed from an earlier one)
        shutil.rmtree(universal_root(root) / tag, ignore_errors=True)  # and its stale conversion
    dist_env.barrier()
    if _adapter_only(run_config):  # QLoRA: the 4-bit base is rebuilt from the model, not saved
        with adapter_only_state_dict(engine.module):
            engine.save_checkpoint(
                str(root), tag=tag, client_state=client_state, save_latest=False, exclude_frozen_parameters=True
            )
    else:
        engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
    torch.save(rng_state(), root / tag / f"rng.rank{dist_env.rank()}.pt")
    if dist_env.rank() == 0 and metrics is not None and Path(metrics).exists():
        shutil.copyfile(metrics, root / tag / "metrics.jsonl")  # the curve so far travels with the state
    dist_env.barrier()
    names = [str(p.relative_to(root / tag)) for p in sorted((root / tag).rglob("*")) if p.is_file()]
    manifest = hash_files(root / tag, names)  # every rank hashes its part
    if dist_env.rank() == 0:
        meta = {"step": step, "world_size": world, "run_config": run_config, "files": manifest, **client_state}
        write_json_atomic(root / tag / MANIFEST, meta)
        write_text_atomic(root / tag / COMPLETE, complete_text(tag, sha256_file(root / tag / MANIFEST)))
        write_text_atomic(root / "latest", tag)
        done = complete_tags(root)
        later = [t for t in done if t > tag]
        kept = [t for t in done if t <= tag]
        for old in later + (kept[:-keep_last] if keep_last > 0 else []):
            shutil.rmtree(root / old, ignore_errors=True)
            shutil.rmtree(universal_root(root) / old, ignore_errors=True)
    dist_env.barrier()
    return root / tag


def remove_incomplete(root: Path, log: Callable[[str], None] = print) -> list[str]:
    """Delete checkpoint directories that were never published (no COMPLETE mark: a save that a
    crash or an OOM interrupted), so that nothing half-written stays beside the checkpoints.
    `latest_valid` ignores them anyway; a later save of the same step replaces them too."""
    root = Path(root)
    if not root.is_dir():
        return []
    gone = sorted(
        p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("step") and not (p / COMPLETE).exists()
    )
    for tag in gone:
        shutil.rmtree(root / tag, ignore_errors=True)
        shutil.rmtree(universal_root(root) / tag, ignore_errors=True)
        log(f"removed the unpublished (half-written) checkpoint {root / tag}")
    return gone


def complete_tags(root: Path) -> list[str]:
    """Published checkpoints, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and (p / COMPLETE).exists())


def latest_valid(
    root: Path, log: Callable[[str], None] = print, digests: bool = False, max_step: int | None = None
) -> tuple[Path, str] | None:
    """The checkpoint `latest` names, else the newest published one, that passes the checks:
    COMPLETE's digest of memfit.json, a sound manifest, every file at its recorded size, a step
    within `max_step` and, with `digests` (what a resume uses; collective then), every file's
    SHA-256. Each one passed over is named in a warning with the reason."""
    root = Path(root)
    tags = complete_tags(root)
    pointer = root / "latest"
    named = pointer.read_text(errors="replace").strip() if pointer.is_file() else None
    order = ([named] if named in tags else []) + [t for t in reversed(tags) if t != named]
    rejected: list[tuple[str, str]] = []
    for tag in order:
        meta, problem = (verify if digests else manifest_problem)(root / tag, max_step)
        problem = problem or rng_problem(root / tag, meta)
        if problem is None:
            for bad, why in rejected:
                log(f"warning: checkpoint {root / bad} is incomplete or corrupt; falling back to {root / tag}: {why}")
            return root, tag
        rejected.append((tag, problem))
    for bad, why in rejected:
        log(f"warning: checkpoint {root / bad} is incomplete or corrupt: {why}")
    if named or rejected:
        log(f"warning: no valid checkpoint under {root} ('latest' names {named}); starting fresh")
    return None


def _adapter_only(run_config: dict[str, Any]) -> bool:
    """Whether the run's checkpoints hold the adapter only (memfit.train.adapter_state)."""
    return run_config.get("candidate", {}).get("finetune") == "qlora"


def load(
    engine, root: Path, tag: str, run_config: dict[str, Any], mode: str | None = None, seed: int = 0
) -> dict[str, Any]:
    """Refuse a checkpoint of another run, then load shards, scheduler and RNG states.

    `mode` UNIVERSAL_LOAD reads the conversion under `<root>/universal/<tag>` (made by
    `ensure_universal`; the engine must have been built with `checkpoint.load_universal`). When the
    number of ranks changed, each rank's RNG is reseeded from (seed, step, rank) instead of restored.
    """
    root = Path(root)
    meta, problem = verify(root / tag)  # right before anything is read (no re-hash of unchanged files)
    if problem is not None:
        raise CheckpointError(
            f"checkpoint {root / tag} cannot be loaded: {problem}. Nothing was loaded; re-run to fall "
            "back to the previous checkpoint (resume: auto), or delete this one."
        )
    found = check_compatible(meta, run_config, root / tag)
    mode = mode or found
    if mode != found:
        raise ValueError(f"checkpoint {root / tag}: planned resume mode {mode!r} but the checkpoint needs {found!r}")
    load_root = universal_root(root) if mode == UNIVERSAL_LOAD else root
    if mode == UNIVERSAL_LOAD and not getattr(engine, "load_universal_checkpoint", lambda: False)():
        raise RuntimeError(
            f"checkpoint {root / tag} needs a universal load, but the engine was built without "
            "checkpoint.load_universal"
        )
    if mode == UNIVERSAL_LOAD:
        _verify_conversion(root, tag)
    adapter = {"custom_load_fn": load_adapter_state} if _adapter_only(run_config) else {}
    # files mapped and copied a chunk at a time (memfit.train.stream_load); m and v copied into the
    # state that exists (memfit.train.optimizer_load): the load holds no second copy of anything
    ours = checkpoint_loader() == "memfit"
    with (
        safe_loads(),  # every torch.load of DeepSpeed's loader: weights_only=True, allow-listed classes
        in_place_loading(engine) if ours else contextlib.nullcontext(),
        streamed_loading(engine) if ours else contextlib.nullcontext(),
    ):
        path, client = engine.load_checkpoint(
            str(load_root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True, **adapter
        )
        said = (client or {}).get("step")
        del client
        own_memory(getattr(engine, "module", None), base_optimizer(getattr(engine, "optimizer", None)))
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {load_root / tag}")
    _check_restored_step(engine, said, int(meta["step"]), root / tag)
    replay_adam_steps(engine.optimizer)  # the CPU Adam kernel's beta powers, as if never stopped
    if mode == SAME:
        load_rng_state(root / tag / f"rng.rank{dist_env.rank()}.pt")
    else:
        reseed(seed, int(meta["step"]), dist_env.rank())
    # free what loading left behind before the first step, so resume peaks no higher than training
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return meta


def _check_restored_step(engine, client_step: Any, step: int, where: Path) -> None:
    """The step memfit.json states is the one DeepSpeed restored (engine.global_steps, read from
    the model-states file by engine.py `_load_checkpoint`) and the one memfit's client state saved
    beside it; every rank decides together. A difference is a corrupt checkpoint."""
    ds_step = getattr(engine, "global_steps", step)
    ok = ds_step == step and (client_step is None or client_step == step)
    if not world_agrees(ok):
        raise CheckpointError(
            f"checkpoint {where}: memfit.json says step {step}, DeepSpeed restored step {ds_step} "
            f"(client state: {client_step}) on rank {dist_env.rank()}; the checkpoint is corrupt. Delete it "
            "and re-run to resume from the previous one."
        )


def checkpoint_loader() -> str:
    """Who loads a checkpoint: "memfit" (streamed, in place) unless LOADER_ENV says "deepspeed"."""
    loader = os.environ.get(LOADER_ENV, "memfit")
    if loader not in ("memfit", "deepspeed"):
        raise ValueError(f"{LOADER_ENV}={loader!r}: must be memfit or deepspeed")
    return loader


# --------------------------------------------------------------------------- universal checkpoints
def universal_root(root: Path) -> Path:
    return Path(root) / UNIVERSAL


def _conversion_is_current(conv: Path, src: Path) -> bool:
    """A finished conversion (published by rename) made from exactly this checkpoint (the SHA-256
    of its memfit.json), with a `files` manifest of its own."""
    try:
        made_from = json.loads((conv / UNIVERSAL_SOURCE).read_text())
        return made_from["source_sha256"] == sha256_file(src / MANIFEST) and isinstance(made_from["files"], dict)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def record_conversion(conv: Path, src: Path, changed: list[str] | None = None) -> None:
    """Record in `conv` the SHA-256 of `src`'s memfit.json and every file of `conv` (size, SHA-256);
    with `changed`, update those files' entries only."""
    conv, src = Path(conv), Path(src)
    if changed is None:
        names = [
            str(p.relative_to(conv)) for p in sorted(conv.rglob("*")) if p.is_file() and p.name != UNIVERSAL_SOURCE
        ]
        made = {"source_sha256": sha256_file(src / MANIFEST), "files": file_entries(conv, names)}
    else:
        made = json.loads((conv / UNIVERSAL_SOURCE).read_text())
        made["files"].update(file_entries(conv, changed))
    write_json_atomic(conv / UNIVERSAL_SOURCE, made)


def _verify_conversion(root: Path, tag: str) -> None:
    """Every file of `<root>/universal/<tag>` as the conversion recorded it (collective)."""
    conv = universal_root(root) / tag
    files = (
        json.loads((conv / UNIVERSAL_SOURCE).read_text())["files"] if _conversion_is_current(conv, root / tag) else None
    )
    problem = (
        verify_files(conv, files)
        if world_agrees(files is not None)
        else f"{conv / UNIVERSAL_SOURCE} is stale or unreadable"
    )
    if problem is not None:
        raise CheckpointError(
            f"the universal conversion {conv} cannot be loaded: {problem}. Nothing was loaded; delete {conv} "
            "and re-run to convert the checkpoint again."
        )


def ensure_universal(root: Path, tag: str, log: Callable[[str], None] = print) -> Path:
    """`<root>/universal/<tag>`: DeepSpeed's universal checkpoint of `<root>/<tag>`, converted once.

    Rank 0 converts (DeepSpeed's converter reading the verified source with weights_only=True)
    into `universal/.<tag>.tmp`, records the source memfit.json's SHA-256 and every converted
    file's size and SHA-256 in it and renames it into place; a conversion of the same checkpoint
    whose files still match is reused, a stale or altered one replaced. Every rank returns once
    the conversion exists, or raises if rank 0's conversion failed.
    """
    root = Path(root)
    src, dest = root / tag, universal_root(root) / tag
    convert = not _conversion_is_current(dest, src)  # every rank sees the same files here
    if not world_agrees(not convert):
        convert = True
    elif problem := verify_files(dest, json.loads((dest / UNIVERSAL_SOURCE).read_text())["files"]):
        log(f"warning: the universal conversion {dest} is not as it was written ({problem}); converting again")
        convert = True
    if convert:
        _, problem = verify(src)  # collective; unchanged since the resume chose it: not hashed again
        if problem is not None:
            raise CheckpointError(f"checkpoint {src} cannot be converted to a universal checkpoint: {problem}")
        # the conversion holds fp32 weights and both Adam moments again, about the source's size
        needed = int(dir_bytes(src) * 1.1)
        universal_root(root).mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(universal_root(root)).free
        if dist_env.min_over_ranks(free - needed) < 0:
            raise CheckpointError(
                f"not enough disk to convert {src} to a universal checkpoint under {universal_root(root)}: "
                f"{gib(needed)} needed (the checkpoint's size + 10%), {gib(free)} free. "
                "Nothing was written; free space, or resume on the number of ranks that wrote it."
            )
    error: BaseException | None = None
    if dist_env.rank() == 0 and convert:
        tmp = universal_root(root) / f".{tag}.tmp"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.parent.mkdir(parents=True, exist_ok=True)
            log(f"converting {src} to a universal checkpoint (resume on a different number of ranks)")
            with safe_loads():
                _convert_to_universal(src, tmp)
            record_conversion(tmp, src)
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(tmp, dest)
            # ds_to_universal points `latest_universal` (beside its output) at the temporary name
            write_text_atomic(universal_root(root) / "latest_universal", tag)
        except BaseException as e:  # noqa: BLE001 - re-raised below, after telling the other ranks
            error = e
            shutil.rmtree(tmp, ignore_errors=True)
    if dist_env.min_over_ranks(0.0 if error is not None else 1.0) < 1.0:
        if error is not None:
            raise CheckpointError(f"converting {src} to a universal checkpoint failed: {error}") from error
        raise CheckpointError(f"converting {src} to a universal checkpoint failed on rank 0 (see its log)")
    return dest


def universal_for_stage(root: Path, tag: str, stage: int) -> None:
    """Make `<root>/universal/<tag>` loadable by a ZeRO-`stage` engine when another stage wrote it
    (an OOM fallback from ZeRO-1/2 to ZeRO-3; see `layout_change_mode`). Rank 0 fixes, all wait.

    - A universal load restores weights and optimizer state from `zero/`, but still reads the
      scheduler, step counters and client state from one model-states file, whose name depends on
      the loading stage (engine.py `_get_ckpt_name`: `zero_pp_rank_0_mp_rank_*_model_states.pt`
      under ZeRO-3, `mp_rank_*_model_states.pt` otherwise); `ds_to_universal` keeps the name the
      writing stage used, so a copy under the other name is added.
    - ZeRO-3's loader reads Adam's step from `zero/optimizer_state.pt`'s
      `optimizer_state_dict.state[0].step` and the hyperparameters from its `param_groups`
      (stage3.py `load_hp_checkpoint_state_from_checkpoint_dir_stage3`); a ZeRO-1/2 conversion
      keeps the step per parameter (`zero/<param>/step.pt`) and the groups at the top level
      (ds_to_universal.py `_save_optimizer_state`): they are copied into that key.
    """
    conv = universal_root(root) / tag
    _verify_conversion(root, tag)  # before anything of it is read (collective)
    if dist_env.rank() == 0:
        changed: list[str] = []
        z3_name, plain_name = "zero_pp_rank_0_mp_rank_00_model_states.pt", "mp_rank_00_model_states.pt"
        want, have = (z3_name, plain_name) if stage == 3 else (plain_name, z3_name)
        if not (conv / want).exists() and (conv / have).exists():
            shutil.copyfile(conv / have, conv / f".{want}.tmp")
            os.replace(conv / f".{want}.tmp", conv / want)
            changed.append(want)
        optim = conv / "zero" / "optimizer_state.pt"
        if stage == 3 and optim.exists():
            sd = load_weights_only(optim)
            if "optimizer_state_dict" not in sd:
                steps = {_as_number(load_weights_only(f)) for f in sorted((conv / "zero").glob("*/step.pt"))}
                if len(steps) != 1:
                    raise CheckpointError(f"{conv}: expected one Adam step over all parameters, found {sorted(steps)}")
                groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
                sd["optimizer_state_dict"] = {"state": {0: {"step": steps.pop()}}, "param_groups": groups}
                torch.save(sd, conv / "zero" / ".optimizer_state.pt.tmp")
                os.replace(conv / "zero" / ".optimizer_state.pt.tmp", optim)
                changed.append("zero/optimizer_state.pt")
        if changed:  # the manifest follows what memfit itself rewrote
            record_conversion(conv, Path(root) / tag, changed)
    dist_env.barrier()


def _as_number(step: Any) -> Any:
    """A step.pt's Adam step (a number, or a one-element tensor) as a hashable number."""
    return step.item() if torch.is_tensor(step) and step.numel() == 1 else step


def _convert_to_universal(src: Path, out: Path) -> None:
    """DeepSpeed's own converter (deepspeed/checkpoint/ds_to_universal.py `main`), in-process.

    One extraction and one merge worker: `_do_parallel_work` runs serially below two workers, so
    the conversion holds one source shard at a time. `inject_missing_state`: ZeRO-1/2 conversion
    asserts a `universal_checkpoint_info` entry that only Megatron-DeepSpeed models save
    (`_check_for_required_state`); the converter's own flag adds the default one.
    """
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(
        input_folder=str(src),
        output_folder=str(out),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    ds_to_universal.main(args)


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
