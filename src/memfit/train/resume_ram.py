"""Host RAM for a resume: what each rank reads to the CPU while a checkpoint loads, checked
against the node's available memory before anything is loaded (memfit.train.resume)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from memfit.train import dist as dist_env
from memfit.train.checkpoint import CheckpointError, _conversion_is_current, universal_root
from memfit.train.checkpoint_compat import DIRECT, SAME
from memfit.units import CHECKPOINT_CHUNK_BYTES, gib

_OPTIM_SHARD = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")
_Z3_MODEL = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_model_states\.pt$")


def mem_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (the kernel's estimate of memory available to new work
    without swapping, proc(5)); psutil's figure (the same on Linux) where /proc is absent."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil  # a DeepSpeed dependency

    return int(psutil.virtual_memory().available)


def resume_host_bytes(root: Path, tag: str, mode: str, loader: str = "memfit") -> dict[str, int]:
    """Host bytes one rank reads to the CPU while this checkpoint loads, from the checkpoint's own
    file sizes (a torch.save'd tensor file is as large as the tensors it loads):

    - as saved (SAME, DIRECT), `loader` "deepspeed": the module-states file the rank reads
      (ZeRO-0/1/2: the whole mp_rank_00_model_states.pt; ZeRO-3: its own zero_pp_rank_<r>_...)
      plus its own optimizer shard (engine.py `_get_all_zero_checkpoint_state_dicts` loads only
      the rank's own shard), the largest over ranks, both held at once (an upper bound: DeepSpeed
      drops the module dict before the shard when nothing else holds it); "memfit": those files
      stream through one CHECKPOINT_CHUNK_BYTES window (memfit.train.stream_load);
    - universal: the module-states file of rank 0, zero/optimizer_state.pt, and one parameter's
      full fp32, exp_avg and exp_avg_sq at a time (base_optimizer.py
      `load_hp_checkpoint_state_from_checkpoint_dir` loads each whole tensor, then copies the
      rank's slice into the existing optimizer state), the largest parameter;
    - convert (universal only, before a conversion exists; rank 0 alone): the largest optimizer
      shard plus the largest module-states file, what `ds_to_universal` holds with one worker.
    """
    src = Path(root) / tag
    # memfit.json's manifest, {name: {"size", "sha256"}} (a bare size before digests were recorded)
    manifest = json.loads((src / "memfit.json").read_text())["files"]
    files = {f: e["size"] if isinstance(e, dict) else int(e) for f, e in manifest.items()}
    shards = {int(m.group(1)): size for f, size in files.items() if (m := _OPTIM_SHARD.search(f))}
    z3_models = {int(m.group(1)): size for f, size in files.items() if (m := _Z3_MODEL.search(f))}
    mp_model = max((size for f, size in files.items() if re.fullmatch(r"mp_rank_\d+_model_states\.pt", f)), default=0)
    out: dict[str, int] = {}
    if mode in (SAME, DIRECT):
        ranks = set(shards) | set(z3_models) or {0}
        out["per_rank"] = max(z3_models.get(r, mp_model) + shards.get(r, 0) for r in ranks)
        if loader == "memfit":
            out["per_rank"] = min(out["per_rank"], CHECKPOINT_CHUNK_BYTES)
        return out
    conv = universal_root(root) / tag
    if _conversion_is_current(conv, src):
        model = max(
            (
                p.stat().st_size
                for p in conv.glob("*model_states.pt")
                if p.name.startswith(("mp_rank_", "zero_pp_rank_0_"))
            ),
            default=0,
        )
        zero = conv / "zero"
        optim = (zero / "optimizer_state.pt").stat().st_size if (zero / "optimizer_state.pt").exists() else 0
        biggest = max(
            (sum(f.stat().st_size for f in d.iterdir() if f.is_file()) for d in zero.iterdir() if d.is_dir()),
            default=0,
        )
        out["per_rank"] = model + optim + biggest
    else:
        out["convert"] = max(shards.values(), default=0) + max(list(z3_models.values()) + [mp_model])
    return out


def ensure_host_ram(needed_bytes: int, where: Path, what: str) -> None:
    """Refuse, before anything is loaded, a resume whose torch.load()s would not fit in this node's
    available RAM; every rank decides the same way (the smallest MemAvailable any rank saw)."""
    available = dist_env.min_over_ranks(float(mem_available_bytes()))
    if available < needed_bytes:
        raise CheckpointError(
            f"not enough host RAM to resume from {where}: {what} needs {gib(needed_bytes)} on "
            f"this node, {gib(available)} available (MemAvailable). Nothing was loaded; free "
            "host memory, use fewer ranks per node, or resume on a node with more RAM."
        )
