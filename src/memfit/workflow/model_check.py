"""Does a model directory load? Checked once, up front, before any probe or training job.

A model directory with a missing shard, a truncated download, no tokenizer or an architecture
memfit cannot estimate would otherwise fail in every probe (each in its own log) and end the
workflow with "no candidate fits". `check_model_dir` reads what the jobs will read, cheaply:

- `config.json`: present, JSON, an architecture the estimator models (`memfit.estimate.models.catalog.model`:
  unsupported model types and unmodelled mixture-of-experts fields are refused, naming the field;
  the weights' parameter count is cross-checked against it) and one transformers implements
  without remote code (what `memfit.train.modeling.load_model` loads).
- weights: `model.safetensors.index.json` and every shard its `weight_map` lists (each shard's
  header read with `safetensors.safe_open`, which refuses a file shorter than its header says,
  and holding the tensors the index maps to it); or `model.safetensors`; or `pytorch_model.bin`
  (or its index and shards: zip archives whose directory, at the end of the file, must be intact).
  The order is transformers' own (`modeling_utils.PreTrainedModel.from_pretrained` prefers
  safetensors, then the sharded index, then the .bin files).
- tokenizer: its files present (tokenizer.json, tokenizer.model, vocab.json + merges.txt or
  vocab.txt) and `AutoTokenizer.from_pretrained` loading them.

Every failure is a `ModelCheckError` whose message starts with the offending file.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ModelCheck", "ModelCheckError", "check_model_dir"]

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
TORCH_BIN, TORCH_BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
# Files a transformers tokenizer is built from: the fast tokenizer's tokenizer.json, a
# SentencePiece model (Llama-2, Mistral, Gemma), BPE vocab + merges (GPT-2 style, Qwen) or a
# WordPiece vocab.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


class ModelCheckError(ValueError):
    """The model directory does not load; the message names the file."""


@dataclass(frozen=True)
class ModelCheck:
    """What was checked: the directory, its architecture, the weight and tokenizer files read."""

    path: Path
    arch: Any  # memfit.estimate.models.arch.ModelArch
    weight_files: list[Path] = field(default_factory=list)
    tokenizer_files: list[Path] = field(default_factory=list)


def check_model_dir(path: str | Path, *, weights: bool = True, tokenizer: bool = True) -> ModelCheck:
    """Check that the model directory `path` loads (see the module doc); ModelCheckError if not.

    `weights=False, tokenizer=False` checks config.json and the architecture only (plan-only runs,
    which never load the weights).
    """
    from memfit.train.modeling import ADAPTER_CONFIG, adapter_base

    d = Path(path)
    if not d.is_dir():
        raise ModelCheckError(f"{d}: model directory not found")
    if not (d / "config.json").exists() and (d / ADAPTER_CONFIG).exists():
        # An adapter-only export (peft): its adapter weights here, the model in its base directory.
        try:
            base = adapter_base(d)
        except (FileNotFoundError, ValueError) as e:
            raise ModelCheckError(str(e)) from None
        adapter = _first_existing(d, ("adapter_model.safetensors", "adapter_model.bin"))
        if weights and adapter is None:
            raise ModelCheckError(
                f"{d / 'adapter_model.safetensors'}: missing (no adapter weights beside {ADAPTER_CONFIG})"
            )
        own_tok = tokenizer and _tokenizer_files(d)
        found = check_model_dir(base, weights=weights, tokenizer=tokenizer and not own_tok)
        adapter_files = [_check_weight_file(adapter)] if weights and adapter else []
        tok = _check_tokenizer(d) if own_tok else found.tokenizer_files
        return ModelCheck(d, found.arch, adapter_files + found.weight_files, tok)
    arch = _check_config(d, implemented=weights)
    weight_files = _check_weights(d) if weights else []
    tok = _check_tokenizer(d) if tokenizer else []
    return ModelCheck(d, arch, weight_files, tok)


# ------------------------------------------------------------------------------ config.json
def _check_config(d: Path, implemented: bool) -> Any:
    from memfit.estimate.models import catalog

    cfg = d / "config.json"
    if not cfg.is_file():
        raise ModelCheckError(f"{cfg}: missing (a HF model directory has a config.json)")
    try:
        # parses it (errors name the file), refuses what the estimate does not model (MoE fields
        # included), cross-checks the parameter count against the safetensors it finds
        arch = catalog.model(d, allow_moe=True)
    except ValueError as e:
        msg = str(e)
        raise ModelCheckError(msg if str(d) in msg else f"{cfg}: {msg}") from None
    if implemented:
        # What training loads: transformers' own class for this model_type, never remote code.
        from transformers import AutoConfig

        try:
            AutoConfig.from_pretrained(str(d))
        except (ValueError, KeyError, OSError) as e:
            raise ModelCheckError(
                f"{cfg}: transformers cannot load this config without remote code "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); memfit trains "
                "models transformers implements"
            ) from None
    return arch


# ------------------------------------------------------------------------------ weights
def _check_weights(d: Path) -> list[Path]:
    for index in (SAFETENSORS_INDEX, TORCH_BIN_INDEX):
        if (d / index).is_file() and not (index == TORCH_BIN_INDEX and (d / SAFETENSORS).is_file()):
            return _check_index(d / index)
    single = _first_existing(d, (SAFETENSORS, TORCH_BIN))
    if single is None:
        raise ModelCheckError(
            f"{d / SAFETENSORS}: missing: no weights in {d} (expected {SAFETENSORS}, "
            f"{SAFETENSORS_INDEX} with its shards, {TORCH_BIN} or {TORCH_BIN_INDEX})"
        )
    return [_check_weight_file(single)]


def _check_index(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise TypeError("weight_map is empty or not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelCheckError(f"{index}: not a usable shard index ({type(e).__name__}: {e})") from None
    by_shard: dict[str, list[str]] = {}
    for tensor, shard in weight_map.items():
        by_shard.setdefault(str(shard), []).append(tensor)
    files = []
    for shard, tensors in sorted(by_shard.items()):
        p = index.parent / shard
        if not p.is_file():
            raise ModelCheckError(f"{p}: missing ({index.name} maps {len(tensors)} tensors to it)")
        names = _tensor_names(p)
        absent = [t for t in tensors if t not in names]
        if absent:
            raise ModelCheckError(
                f"{p}: has no tensor {absent[0]!r} ({len(absent)} of the {len(tensors)} that "
                f"{index.name} maps to it are absent): the shard does not match the index"
            )
        files.append(p)
    return files


def _check_weight_file(p: Path) -> Path:
    _tensor_names(p)
    return p


def _tensor_names(p: Path) -> set[str]:
    """The tensors in a weight file, reading its header / zip directory only."""
    if p.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(p), framework="pt") as f:
                return set(f.keys())
        except Exception as e:  # SafetensorError (not importable by name), OSError
            raise ModelCheckError(
                f"{p}: unreadable safetensors file ({e}); a truncated or corrupt download? ({p.stat().st_size:,} bytes)"
            ) from None
    # torch.save's format since torch 1.6: a zip archive (directory at the end, so a truncated
    # file has none) holding data.pkl and one record per storage.
    try:
        with zipfile.ZipFile(p) as z:
            if not any(n.endswith("data.pkl") for n in z.namelist()):
                raise ModelCheckError(f"{p}: a zip archive without data.pkl, not a torch checkpoint")
    except zipfile.BadZipFile:
        return _legacy_torch_names(p)
    except OSError as e:
        raise ModelCheckError(f"{p}: cannot read ({e.strerror or e})") from None
    return set()  # names need the pickle; present and intact is what is checked


def _legacy_torch_names(p: Path) -> set[str]:
    import torch

    try:  # torch < 1.6 files (no zip): loading them is the only check there is
        state = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as e:
        raise ModelCheckError(
            f"{p}: unreadable torch checkpoint ({type(e).__name__}: {e}); truncated or corrupt?"
        ) from None
    return set(state) if isinstance(state, dict) else set()


def _first_existing(d: Path, names: tuple[str, ...]) -> Path | None:
    return next((d / n for n in names if (d / n).is_file()), None)


# ------------------------------------------------------------------------------ tokenizer
def _tokenizer_files(d: Path) -> list[Path]:
    return [d / n for n in TOKENIZER_FILES if (d / n).is_file()]


def _check_tokenizer(d: Path) -> list[Path]:
    files = _tokenizer_files(d)
    if not files:
        raise ModelCheckError(
            f"{d / 'tokenizer.json'}: missing: no tokenizer files in {d} (expected one of "
            f"{', '.join(TOKENIZER_FILES)}); copy them from the model's original repository"
        )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        p = d / name
        if p.is_file():
            try:
                json.loads(p.read_bytes().decode("utf-8"))
            except (OSError, ValueError) as e:
                raise ModelCheckError(f"{p}: not readable JSON ({e})") from None
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(str(d))
    except Exception as e:  # transformers raises OSError, ValueError, tokenizers' Exception ...
        names = ", ".join(p.name for p in files)
        first = str(e).splitlines()[0] if str(e) else ""
        raise ModelCheckError(
            f"{files[0]}: the tokenizer in {d} ({names}) does not load: {type(e).__name__}: {first}"
        ) from None
    return files
