"""What a run starts from, by content: SHA-256 digests of the policy model directory, the DPO
reference model and the prepared data directory (`run_inputs`), recorded in the run config the
ranks read (`RunConfig.inputs`) and so in every checkpoint's memfit.json. A checkpoint, or the
DPO reference log-probs, made from other content is not resumed or reused
(memfit.train.checkpoint_compat, memfit.train.reference), whatever the paths say.

Hashing is streamed (8 MiB reads) and cached by file identity (real path, device, inode, size,
mtime and ctime in nanoseconds) in a small JSON file (`cache_path`), so a 140 GB model is hashed
once per machine, not per run: any write to a file changes its ctime, and a copy or a re-save
gets a new inode. `python -m memfit.train.identity PATH...` prints digests and the hashing rate.

The launching side resolves the digests once (`resolve_launch_config`: memfit.train.launch for
`memfit launch`, memfit.workflow.pipeline.train, verify_resume's launch) into a copy of the run
config inside the run's out_dir; the workflow's run.json, a Snakemake output, is never rewritten.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from memfit.atomic import write_json_atomic
from memfit.digest import sha256_file, stat_signature
from memfit.train.run_config import REFERENCE_METHODS

# The files of a model directory that make the model: weights, configs, tokenizer files
# (tokenizer.json, tokenizer.model, vocab/merges .txt, .tiktoken), a chat template, remote code.
# Top level only: a hub clone's original/ (the same weights in another format), README and
# hidden files (.git, .cache) do not change what transformers loads.
MODEL_SUFFIXES = (".safetensors", ".bin", ".json", ".model", ".txt", ".jinja", ".tiktoken", ".py")
DATA_FILES = ("train.parquet", "eval.parquet", "stats.json")  # memfit.data.prepare's outputs
CACHE_ENV = "MEMFIT_DIGEST_CACHE"  # a path overriding the cache file (tests, read-only homes)
MAX_CACHE_ENTRIES = 20000
# Set by a launcher for the per-node launchers it starts under srun: the config they get was
# resolved already (one digest pass per run, not per node).
RESOLVED_ENV = "MEMFIT_INPUTS_RESOLVED"
ADAPTER_CONFIG = "adapter_config.json"  # peft's, beside an adapter-only export
WHAT = {"model": "the policy model's", "ref": "the reference model's", "data": "the prepared data's"}


class InputError(ValueError):
    """A run's model or data directory is missing or holds nothing to hash (bad input: exit 2)."""


def cache_path() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "memfit" / "sha256.json"


def _load_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, unreadable or corrupt: hash again
        return {}
    return data if isinstance(data, dict) else {}


def _save_cache(path: Path, cache: dict[str, Any]) -> None:
    if len(cache) > MAX_CACHE_ENTRIES:  # the oldest entries go first (insertion order)
        cache = dict(list(cache.items())[-MAX_CACHE_ENTRIES:])
    try:
        write_json_atomic(path, cache)
    except OSError:  # a read-only cache directory costs time, never the run
        pass


def file_digests(files: list[Path], use_cache: bool = True) -> dict[Path, str]:
    """SHA-256 of each file, from the cache where the file's identity is unchanged."""
    where = cache_path()
    cache = _load_cache(where) if use_cache else {}
    out, changed = {}, False
    for p in files:
        real = os.path.realpath(p)
        ident = list(stat_signature(os.stat(real)))
        hit = cache.get(real)
        if isinstance(hit, dict) and hit.get("id") == ident and isinstance(hit.get("sha256"), str):
            out[p] = hit["sha256"]
            continue
        out[p] = sha256_file(Path(real))
        if list(stat_signature(os.stat(real))) == ident:  # not written while it was read
            cache.pop(real, None)
            cache[real] = {"id": ident, "sha256": out[p]}
            changed = True
    if changed and use_cache:
        _save_cache(where, cache)
    return out


def model_files(model_dir: Path) -> list[Path]:
    return sorted(p for p in Path(model_dir).iterdir() if p.is_file() and p.suffix in MODEL_SUFFIXES)


def data_files(data_dir: Path) -> list[Path]:
    return [Path(data_dir) / n for n in DATA_FILES if (Path(data_dir) / n).is_file()]


def tree_digest(files: list[Path], root: Path, use_cache: bool = True) -> str:
    """One SHA-256 over the directory's files: each file's name and SHA-256, in name order."""
    digests = file_digests(files, use_cache)
    h = hashlib.sha256()
    for p in sorted(files, key=lambda p: p.name):
        h.update(f"{p.relative_to(root).as_posix()}\0{digests[p]}\n".encode())
    return h.hexdigest()


def input_problems(cfg: Any) -> list[str]:
    """What a run config's model, reference or data path lacks, each naming its key and path."""
    out = []
    paths = [("model_path", cfg.model_path, "a model directory (config.json, weights, tokenizer)")]
    if cfg.ref_model_path:
        paths.append(("ref_model_path", cfg.ref_model_path, "the DPO reference model directory"))
    paths.append(("data_dir", cfg.data_dir, "prepare_data's output (train.parquet, eval.parquet, stats.json)"))
    for key, value, want in paths:
        p = Path(value)
        if not p.exists():
            out.append(
                f"{key} {value!r} does not exist (expected {want}; memfit reads local directories and never downloads)"
            )
        elif not p.is_dir():
            out.append(f"{key} {value!r} is not a directory (expected {want})")
        elif key == "data_dir" and not (p / "train.parquet").is_file():
            out.append(f"{key} {value!r} has no train.parquet (expected {want}; run prepare_data)")
        elif key != "data_dir" and not (p / "config.json").is_file() and not (p / ADAPTER_CONFIG).is_file():
            out.append(f"{key} {value!r} has no config.json, nor peft's {ADAPTER_CONFIG} (expected {want})")
    return out


def model_digest(path: Path) -> str:
    """The SHA-256 of a model directory's files; for an adapter-only export (peft's
    adapter_config.json, no config.json: `export: adapter`) combined with its base model's, which
    memfit.train.modeling loads under it from `base_model_name_or_path`."""
    own = tree_digest(model_files(path), path)
    if (path / "config.json").is_file() or not (path / ADAPTER_CONFIG).is_file():
        return own
    try:
        base = json.loads((path / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError) as e:
        raise InputError(f"{path / ADAPTER_CONFIG}: not readable JSON ({e})") from None
    if not base or not (Path(base) / "config.json").is_file():
        raise InputError(
            f"{path / ADAPTER_CONFIG}: base_model_name_or_path {base!r} is not a local model directory "
            "(no config.json): an adapter-only export needs the base model it was trained on"
        )
    return hashlib.sha256(
        f"adapter {own}\nbase {tree_digest(model_files(Path(base)), Path(base))}\n".encode()
    ).hexdigest()


def run_inputs(cfg: Any) -> dict[str, str]:
    """{"model", "ref", "data"}: the SHA-256 of what `cfg` starts from ("ref" only for DPO: the
    reference model, which is the policy model unless ref_model_path names another). InputError
    naming the key when a path is missing."""
    problems = input_problems(cfg)
    if problems:
        raise InputError("; ".join(problems))
    model = Path(cfg.model_path)
    out = {"model": model_digest(model)}
    if cfg.method in REFERENCE_METHODS:
        ref = Path(cfg.ref_model_path or cfg.model_path)
        out["ref"] = out["model"] if ref.resolve() == model.resolve() else model_digest(ref)
    out["data"] = tree_digest(data_files(Path(cfg.data_dir)), Path(cfg.data_dir))
    return out


def changes(then: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Each input whose content differs between two `inputs` records, as a sentence (a key that
    one side lacks is not compared: a checkpoint that predates digests is judged by its paths)."""
    return [
        f"{WHAT.get(k, k)} content changed: sha256 {then[k][:12]}.. -> {now[k][:12]}.."
        for k in WHAT
        if then.get(k) and now.get(k) and then[k] != now[k]
    ]


def resolved_path(config: Path, out_dir: str | Path) -> Path:
    """Where the launch writes the copy of `config` with its digests: `<out_dir>/<name>.resolved.json`."""
    name = config.name if config.name.endswith(".resolved.json") else f"{config.stem}.resolved.json"
    return Path(out_dir) / name


def with_inputs(cfg: Any) -> Any:
    """`cfg` (a RunConfig) with `inputs` computed from the content now."""
    return dataclasses.replace(cfg, inputs=run_inputs(cfg))


def resolve_launch_config(config: Path) -> Path:
    """The run config the ranks of a launch read: `config` itself for a probe (no checkpoints, no
    cache) or when it already records the content as it is now, else a copy with `inputs` in the
    run's out_dir (`resolved_path`). InputError when a path is missing, ValueError when the run
    config is invalid: both before any rank starts."""
    from memfit.train.run_config import RunConfig

    config = Path(config)
    try:
        cfg = RunConfig.load(config)
    except (ValueError, TypeError) as e:
        msg = str(e)
        raise ValueError(msg if str(config) in msg else f"{config}: {msg}") from None
    if cfg.probe_steps:
        problems = input_problems(cfg)
        if problems:
            raise InputError(f"{config}: " + "; ".join(problems))
        return config
    if os.environ.get(RESOLVED_ENV) == "1" and cfg.inputs:
        return config
    try:
        now = with_inputs(cfg)
    except InputError as e:
        raise InputError(f"{config}: {e}") from None
    if now.inputs == cfg.inputs:
        return config
    dest = resolved_path(config, cfg.out_dir)
    now.save(dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    """`python -m memfit.train.identity PATH...`: each path's SHA-256 (a directory: as a model
    directory, or a data directory when it holds train.parquet) and the rate it was hashed at
    (`--no-cache` measures the hashing itself)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m memfit.train.identity", description=main.__doc__)
    ap.add_argument("paths", nargs="+", type=Path)
    ap.add_argument("--no-cache", action="store_true", help="hash every file again (measure the rate)")
    args = ap.parse_args(argv)
    for p in args.paths:
        if not p.exists():
            print(f"{p}: no such file or directory", file=sys.stderr)
            return 2
        files = [p] if p.is_file() else data_files(p) if (p / "train.parquet").exists() else model_files(p)
        size = sum(f.stat().st_size for f in files)
        t0 = time.perf_counter()
        use = not args.no_cache
        digest = file_digests(files, use)[p] if p.is_file() else tree_digest(files, p, use)
        dt = time.perf_counter() - t0
        rate = f"{size / 1e6 / dt:.0f} MB/s" if dt > 0 else "-"
        print(f"{digest}  {p}  ({len(files)} files, {size / 1e6:.1f} MB in {dt:.2f} s: {rate})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
