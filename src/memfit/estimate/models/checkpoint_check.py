"""Does a model directory's checkpoint hold the parameters its config.json describes?

`check_checkpoint` counts the weights in the safetensors files (their headers, or the index's
total size over the dtype's bytes) against the architecture card read from the config, so that a
card mis-read from a config, or weights that do not belong to it, fail before any estimate is
trusted. memfit.estimate.models.catalog runs it for every local model directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memfit.estimate.models.arch import ModelArch, UnsupportedArchitecture
from memfit.units import MIB

# Bytes per parameter of the dtypes a config.json names (torch_dtype, or dtype in
# transformers >= 5) and of the safetensors header dtypes.
_DTYPE_BYTES = {
    "float32": 4, "float": 4, "F32": 4,
    "float16": 2, "half": 2, "F16": 2,
    "bfloat16": 2, "BF16": 2,
    "float64": 8, "F64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8, "BOOL": 1,
}  # fmt: skip
CHECKPOINT_TOLERANCE = 0.01  # relative: buffers (rotary inv_freq, router score biases) are tiny


def check_checkpoint(arch: ModelArch, model_dir: str | Path) -> int | None:
    """Cross-check the architecture's parameter count against the weights in `model_dir`.

    Reads `model.safetensors.index.json` (`metadata.total_size` bytes / the config's dtype) or,
    for a single `model.safetensors`, its header (every tensor's shape: an exact count; the
    safetensors format is an 8-byte little-endian header length, then a JSON header). Raises
    UnsupportedArchitecture, naming the file, when the weights hold more than 1% more or fewer
    parameters than `num_params() + vision_params` (a config that does not describe the weights:
    an unmodelled architecture, extra heads or layers). Returns the checkpoint's count, or None
    when there is nothing to check (no safetensors; quantized weights, whose bytes per
    parameter the dtype does not give).
    """
    d = Path(model_dir)
    expected = arch.num_params() + arch.vision_params
    raw = _read_config_dict(d / "config.json")
    index, single = d / "model.safetensors.index.json", d / "model.safetensors"
    if raw.get("quantization_config"):
        return None
    if index.is_file():
        try:
            total = int(json.loads(index.read_text())["metadata"]["total_size"])
        except (ValueError, KeyError, TypeError, OSError):
            return None  # no usable total: nothing to compare (the loader will complain)
        dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "")
        per = _DTYPE_BYTES.get(dtype.replace("torch.", ""))
        if per is None:
            return None
        found, what, where = (
            total // per,
            f"metadata.total_size {total:,} bytes / {per} ({dtype})",
            index,
        )
    elif single.is_file():
        found, where = _safetensors_numel(single), single
        if found is None:
            return None
        what = "its tensors"
    else:
        return None
    if abs(found - expected) > CHECKPOINT_TOLERANCE * expected:
        raise UnsupportedArchitecture(
            f"{where}: {what} = {found:,} parameters, but config.json describes {expected:,} "
            f"({(found - expected) / expected:+.1%}): the weights are not the architecture memfit "
            f"reads from config.json, so it refuses rather than guessing"
        )
    return found


def _read_config_dict(p: Path) -> dict[str, Any]:
    try:
        data = json.loads(p.read_bytes().decode("utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _safetensors_numel(p: Path) -> int | None:
    """Total elements of the tensors in a .safetensors file, from its header only."""
    import struct

    try:
        with p.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return None
            (n,) = struct.unpack("<Q", head)
            if n > 100 * MIB:
                return None
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return None
    total = 0
    for key, t in header.items():
        if key == "__metadata__" or not isinstance(t, dict):
            continue
        numel = 1
        for s in t.get("shape", ()):
            numel *= int(s)
        total += numel
    return total


# ----------------------------------------------------------------------------- helpers
