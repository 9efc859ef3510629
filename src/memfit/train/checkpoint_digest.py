"""What is checked before any file of a checkpoint is read, and how memfit reads it without
running code from the run folder (a run folder is not a trusted place: cluster file systems are
shared, and a pickle runs whatever its author put in it).

Digests. At save time every file of a checkpoint is hashed (SHA-256, hashlib, read in
8 MiB blocks, memfit.digest) into memfit.json's `files` manifest, `{name: {"size", "sha256"}}`, and the
COMPLETE mark records the SHA-256 of memfit.json itself. `manifest_problem` reads COMPLETE and
memfit.json (cheap: sizes only); `verify` also hashes every listed file. Either returns what is
wrong in words naming the file, or None. Ranks share the hashing: each hashes its part of the
files (largest first, to the least loaded rank), the verdicts are reduced over the ranks, so every
rank chooses the same checkpoint. A file this process hashed and found matching is not hashed
again while its inode, size, mtime and ctime are unchanged (ctime cannot be set back by a user
process: any write to the file moves it).

No pickle executed. `safe_loads()` makes every `torch.load` inside it (memfit's and DeepSpeed's:
the shards, the universal conversion and its loader) a `weights_only=True` load with
`_allowed_globals()`, the classes DeepSpeed 0.19's shards hold besides tensors and containers.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from memfit.digest import sha256_file, stat_signature
from memfit.train import dist as dist_env

MANIFEST = "memfit.json"
COMPLETE = "COMPLETE"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_COMPLETE_LINE = re.compile(r"memfit\.json sha256 ([0-9a-f]{64})")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the previous one is left as it was."""


def _signature(path: Path) -> tuple[int, ...] | None:
    try:
        return stat_signature(os.stat(path))
    except OSError:
        return None


# resolved path -> (signature, sha256) of files this process hashed and found as the manifest says
_verified: dict[str, tuple[tuple[int, ...], str]] = {}


def _shares(sizes: list[int], world: int) -> list[int]:
    """Which rank hashes each file: largest first, to the rank with the fewest bytes so far."""
    load = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


def _ranks() -> tuple[int, int]:
    if dist_env.initialized():
        import torch.distributed as tdist

        return tdist.get_rank(), tdist.get_world_size()
    return 0, 1


def file_entries(directory: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """`{name: {"size", "sha256"}}` of files under `directory`, hashed here."""
    return {
        n: {"size": (Path(directory) / n).stat().st_size, "sha256": sha256_file(Path(directory) / n)} for n in names
    }


def hash_files(directory: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """`file_entries` hashed by the ranks together: collective where a process group exists (every
    rank lists the same files; each hashes its share and the digests are summed over the ranks as
    bytes, every other rank contributing zeros)."""
    rank, world = _ranks()
    if world == 1:
        return file_entries(directory, names)
    listing = hashlib.sha256("\n".join(names).encode()).digest()
    seen = torch.tensor(list(listing[:6]), dtype=torch.float64)  # 48 bits: exact in float64
    if dist_env.all_reduce_tensor(seen, "min").tolist() != dist_env.all_reduce_tensor(seen, "max").tolist():
        raise CheckpointError(f"the ranks see different files in {directory}: is it on a file system they share?")
    sizes = [(Path(directory) / n).stat().st_size for n in names]
    digests = torch.zeros(len(names), 32, dtype=torch.int64)
    for i, r in enumerate(_shares(sizes, world)):
        if r == rank:
            digests[i] = torch.tensor(list(bytes.fromhex(sha256_file(Path(directory) / names[i]))))
    digests = dist_env.all_reduce_tensor(digests, "sum")
    return {
        n: {"size": size, "sha256": bytes(row).hex()}
        for n, size, row in zip(names, sizes, digests.tolist(), strict=True)
    }


def complete_text(tag: str, manifest_sha256: str) -> str:
    """The COMPLETE mark: the tag, and the SHA-256 of the memfit.json it publishes."""
    return f"{tag}\n{MANIFEST} sha256 {manifest_sha256}\n"


def manifest_problem(path: Path, max_step: int | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """(memfit.json's content, None) when the checkpoint's COMPLETE mark and manifest are sound and
    every listed file has its recorded size; (None, what is wrong, naming the file) otherwise.
    `max_step`: the run's last step; a checkpoint beyond it is not this run's."""
    path = Path(path)
    try:
        mark = (path / COMPLETE).read_text()
    except (OSError, UnicodeDecodeError):
        return None, f"{path / COMPLETE} is missing or unreadable (the save never finished)"
    m = _COMPLETE_LINE.search(mark)
    if not m:
        return None, (
            f"{path / COMPLETE} records no SHA-256 of {MANIFEST}: a checkpoint written before memfit "
            "checked digests (or an edited mark); its files cannot be verified"
        )
    try:
        raw = (path / MANIFEST).read_bytes()
    except OSError:
        return None, f"{path / MANIFEST} is missing"
    if hashlib.sha256(raw).hexdigest() != m.group(1):
        return (
            None,
            f"{path / MANIFEST} was changed after the checkpoint was published (its SHA-256 differs from COMPLETE's)",
        )
    try:
        meta = json.loads(raw)
    except ValueError as e:
        return None, f"{path / MANIFEST} is not valid JSON ({e})"
    files = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(files, dict) or not files:
        return None, f"{path / MANIFEST} has no `files` manifest"
    for name, entry in files.items():
        ok = (
            isinstance(entry, dict)
            and isinstance(entry.get("size"), int)
            and _HEX64.fullmatch(str(entry.get("sha256")))
        )
        if not ok or Path(name).is_absolute() or ".." in Path(name).parts:
            return None, f"{path / MANIFEST}: malformed `files` entry {name!r} (needs a size and a SHA-256)"
    step, world = meta.get("step"), meta.get("world_size")
    if not isinstance(step, int) or isinstance(step, bool) or f"step{step:08d}" != path.name:
        return None, f"{path / MANIFEST}: step {step!r} does not match the checkpoint's directory {path.name}"
    if max_step is not None and step > max_step:
        return None, f"{path / MANIFEST}: step {step} is beyond the run's end ({max_step} steps)"
    if not isinstance(world, int) or world < 1:
        return None, f"{path / MANIFEST}: world_size {world!r} is not a number of ranks"
    for name, entry in sorted(files.items()):
        f = path / name
        if not f.is_file():
            return None, f"{f} is missing"
        if f.stat().st_size != entry["size"]:
            return (
                None,
                f"{f} is {f.stat().st_size} bytes, the manifest says {entry['size']} (truncated or overwritten)",
            )
    return meta, None


def rng_problem(path: Path, meta: dict[str, Any]) -> str | None:
    """A checkpoint must list every writing rank's RNG state (a resume on as many ranks reads them)."""
    world = meta["world_size"]
    missing = [r for r in range(world) if f"rng.rank{r}.pt" not in meta["files"]]
    return (
        f"{Path(path) / MANIFEST} lists no rng.rank{missing[0]}.pt for rank {missing[0]} of {world}"
        if missing
        else None
    )


def verify_files(directory: Path, files: dict[str, dict[str, Any]]) -> str | None:
    """Every file of `files` ({name: {"size", "sha256"}}) under `directory` has its recorded size and
    SHA-256: None, or what is wrong naming the first bad file. Collective where a process group
    exists (every rank calls it with the same `files`); every rank gets the same answer."""
    directory = Path(directory)
    names = sorted(files)
    rank, world = _ranks()
    before = [_signature(directory / n) for n in names]
    owner = _shares([files[n]["size"] for n in names], world)
    dist_env.barrier()  # every rank took its `before` before any hashing starts
    # per file: 0 fine, 1 missing, 2 size differs, 3 SHA-256 differs, 4 changed while being read,
    # 5 unreadable
    codes = [0.0] * len(names)
    for i, n in enumerate(names):
        sig = before[i]
        if sig is None:
            codes[i] = 1
        elif sig[2] != files[n]["size"]:
            codes[i] = 2
        elif owner[i] == rank:
            key = str((directory / n).resolve())
            cached = _verified.get(key)
            if cached != (sig, files[n]["sha256"]):
                try:
                    got = sha256_file(directory / n)
                except OSError:
                    got = None
                if got is None:
                    codes[i] = 5
                elif got != files[n]["sha256"]:
                    codes[i] = 3
                elif _signature(directory / n) != sig:
                    codes[i] = 4
    after = [_signature(directory / n) for n in names]
    codes = [c or (4.0 if a != b else 0.0) for c, a, b in zip(codes, before, after, strict=True)]
    codes = dist_env.all_reduce(codes, "max") if world > 1 else codes
    for n, c in zip(names, codes, strict=True):
        f = directory / n
        if c == 1:
            return f"{f} is missing"
        if c == 2:
            return f"{f} is not {files[n]['size']} bytes as the manifest says (truncated or overwritten)"
        if c == 3:
            return f"{f}: its SHA-256 differs from the manifest's (the file changed since it was saved)"
        if c == 4:
            return f"{f} changed while it was being verified"
        if c == 5:
            return f"{f} cannot be read (permissions?)"
    for n, sig in zip(names, after, strict=True):
        _verified[str((directory / n).resolve())] = (sig, files[n]["sha256"])
    return None


def verify(path: Path, max_step: int | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """`manifest_problem`, then the SHA-256 of every listed file (`verify_files`). Collective."""
    meta, problem = manifest_problem(path, max_step)
    if world_agrees(problem is None):
        return meta, verify_files(path, meta["files"])
    return None, problem or "another rank found this checkpoint's manifest unsound (see its log)"


def world_agrees(ok: bool) -> bool:
    """Whether `ok` holds on every rank (itself without a process group)."""
    return dist_env.min_over_ranks(1.0 if ok else 0.0) == 1.0


# --------------------------------------------------------------------------- no pickle executed
def _allowed_globals() -> list[Any]:
    """Classes DeepSpeed 0.19.8 pickles into its checkpoint shards besides tensors, containers and
    numbers (found by loading the demo's ZeRO-0/1/2/3, bf16/fp32, offload and LoRA checkpoints with
    weights_only=True and reading the refusal; the source lines that save them):

    - LossScaler, DynamicLossScaler: the optimizer shard's `loss_scaler` (stage_1_and_2.py and
      stage3.py `state_dict`: `state_dict[LOSS_SCALER] = self.loss_scaler`; static for bf16/fp32,
      dynamic for fp16); plain numbers inside, restored by setting attributes;
    - ZeroStageEnum: stage3.py `state_dict[ZERO_STAGE] = ZeroStageEnum.weights` (an IntEnum);
    - fragment_address: the `param_slice_mappings` of ZeRO-1/2 and BF16 optimizer shards
      (utils/tensor_fragment.py, a dataclass of two ints: numel, start).
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load_weights_only(path: Any, **kwargs: Any) -> Any:
    """`torch.load(path, weights_only=True)` with `_allowed_globals()`; a refusal names the file."""
    kwargs["weights_only"] = True
    try:
        with torch.serialization.safe_globals(_allowed_globals()):
            return _torch_load(path, **kwargs)
    except pickle.UnpicklingError as e:  # what torch raises for a refused global
        raise CheckpointError(
            f"{path} holds more than tensors and numbers ({_refusal(e)}): refused without "
            "running it. A checkpoint file from a run folder is loaded with weights_only=True; this one "
            "was made by something other than memfit and DeepSpeed, or altered. Delete the checkpoint "
            "(or resume from an earlier one) and re-run."
        ) from e


def _refusal(e: BaseException) -> str:
    """The line of torch's weights_only refusal that names what was refused."""
    parts = [p.strip() for p in str(e).split("\n\n") if p.strip()]
    named = [p for p in parts if "GLOBAL" in p or "got <class" in p or "Unsupported" in p]
    return (named or parts[-1:] or ["unknown"])[0].splitlines()[0][:300]


_torch_load = torch.load


@contextlib.contextmanager
def safe_loads() -> Iterator[None]:
    """While active, every `torch.load(...)` (memfit's, DeepSpeed's loader and converter, whatever
    `weights_only` they pass) loads with weights_only=True and the allow-list."""

    @functools.wraps(_torch_load)
    def load(f, *args, **kwargs):
        kwargs.pop("weights_only", None)
        if args:  # torch.load(f, map_location, pickle_module, ...): only map_location is ever positional
            kwargs.setdefault("map_location", args[0])
        return load_weights_only(f, **kwargs)

    previous = torch.load
    torch.load = load
    try:
        yield
    finally:
        torch.load = previous


def main(argv: list[str] | None = None) -> int:
    """`python -m memfit.train.checkpoint_digest CHECKPOINT_DIR...`: check each checkpoint as a
    resume does (manifest, then every file's SHA-256) and print what the hashing cost. Exit 0
    when all are sound, 1 when one is not (the reason printed), 2 for a path that is no directory."""
    import argparse
    import sys
    import time

    ap = argparse.ArgumentParser(prog="python -m memfit.train.checkpoint_digest", description=main.__doc__)
    ap.add_argument("checkpoints", nargs="+", type=Path, help="checkpoint directories (…/checkpoints/stepNNNNNNNN)")
    args = ap.parse_args(argv)
    missing = [str(p) for p in args.checkpoints if not p.is_dir()]
    if missing:
        print(f"memfit: error: not a checkpoint directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    bad = 0
    for path in args.checkpoints:
        t0 = time.perf_counter()
        meta, problem = verify(path)
        seconds = time.perf_counter() - t0
        if problem is not None:
            print(f"{path}: NOT SOUND: {problem}")
            bad += 1
            continue
        size = sum(e["size"] for e in meta["files"].values())
        rate = size / max(seconds, 1e-9) / 2**30
        print(
            f"{path}: sound, {len(meta['files'])} files, {size / 2**30:.3f} GiB hashed in {seconds:.2f} s "
            f"({rate:.2f} GiB/s, {1 / max(rate, 1e-9):.2f} s per GiB)"
        )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
