"""Which catalog GPU this machine has: nvidia-smi's device name and memory, matched to
`config/gpus.yaml` (the workflow's `gpus: [detect]`, config/gpu-demo.yaml).

nvidia-smi names a product as "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "NVIDIA GeForce
RTX 4090", "Tesla V100-SXM2-32GB", "NVIDIA RTX A6000". The product number ("h100", "a100",
"4090", "a6000", "l40s") picks the catalog entries of that family; the form factor (PCIe or
not) and the memory nvidia-smi reports (`memory.total`, MiB, the catalog's `memory_mib`
convention) pick one of them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from memfit.estimate.models import catalog

DETECT = "detect"  # the name a config uses for "the GPU this machine has"


class DetectError(ValueError):
    """No catalog GPU answers for this machine's device (or there is no NVIDIA GPU)."""


def _family(text: str) -> str | None:
    """The product number of a catalog name or an nvidia-smi token: 'h100', '4090', 'a6000'."""
    m = re.fullmatch(r"(?:rtx)?([a-z]{0,2}\d{1,4}[a-z]?)", text)
    return m.group(1) if m else None


def _tokens(device_name: str) -> list[str]:
    words = re.sub(r"[^a-z0-9]+", " ", device_name.lower()).split()
    return [w for w in words if w not in ("nvidia", "tesla", "geforce", "rtx", "quadro")]


def gpu_for_device(device_name: str, memory_mib: int) -> str:
    """The catalog name of a device nvidia-smi reports as `device_name` with `memory_mib` MiB."""
    tokens = _tokens(device_name)
    gpus = [g for g in catalog.load_gpus().values() if g.name != "cpu" and not g.planning_only]
    families = {_family(t) for t in tokens} - {None}
    same = [g for g in gpus if _family(g.name.split("-")[0]) in families]
    if not same:
        raise DetectError(
            f"no catalog GPU for {device_name!r} ({memory_mib} MiB): name one in `gpus:` "
            f"(config/gpus.yaml: {', '.join(sorted(g.name for g in gpus))}) or add it to the catalog"
        )
    pcie = "pcie" in tokens or "nvl" in tokens  # NVL parts are PCIe cards (bridged in pairs)

    def distance(g: catalog.GPU) -> tuple[bool, bool, int]:
        off = abs(g.memory_bytes // 2**20 - memory_mib)
        return off > 0.1 * memory_mib, ("pcie" in g.name) != pcie, off  # memory first, then form factor

    best = min(same, key=distance)
    if distance(best)[0]:  # a sibling the catalog lacks (H100 NVL's 94 GB): not another card's budget
        raise DetectError(
            f"no catalog GPU for {device_name!r} ({memory_mib} MiB): the nearest, {best.name}, has "
            f"{best.memory_bytes // 2**20} MiB; name the GPU in `gpus:` or add it to config/gpus.yaml"
        )
    return best.name


def smi_devices() -> list[tuple[str, int]]:
    """(name, memory.total MiB) of each GPU nvidia-smi lists (those CUDA_VISIBLE_DEVICES names,
    where it is set to indices)."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        raise DetectError(
            "gpus: [detect] found no NVIDIA GPU (no nvidia-smi on PATH): name the GPU, e.g. gpus: [h100-80gb]"
        )
    cmd = [exe, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise DetectError(f"gpus: [detect]: nvidia-smi failed ({p.stderr.strip()[:300]}); name the GPU instead")
    rows = [[c.strip() for c in line.split(",")] for line in p.stdout.splitlines() if line.strip()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and all(v.strip().isdigit() for v in visible.split(",") if v.strip()):
        keep = {v.strip() for v in visible.split(",")}  # "" hides every GPU, as it does from CUDA
        rows = [r for r in rows if r[0] in keep]
    try:
        return [(r[1], int(float(r[2]))) for r in rows]
    except (IndexError, ValueError):
        raise DetectError(
            f"gpus: [detect]: cannot read nvidia-smi's answer {p.stdout.strip()[:200]!r}; name the GPU"
        ) from None


def detect_gpu() -> str:
    """The catalog name of this machine's GPUs (all of one kind), from nvidia-smi."""
    devices = smi_devices()
    if not devices:
        raise DetectError("gpus: [detect]: nvidia-smi lists no GPU; name the GPU instead, e.g. gpus: [h100-80gb]")
    names = {gpu_for_device(n, m) for n, m in devices}
    if len(names) > 1:
        raise DetectError(f"gpus: [detect]: this machine has GPUs of several kinds ({sorted(names)}); name one")
    return names.pop()
