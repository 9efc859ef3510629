"""Is a measurement of the configured GPU? A measured device (memfit.train.device_info: the
name torch reports and its total memory) matched to a catalog GPU the way `gpus: [detect]` matches
nvidia-smi's answer (memfit.estimate.models.detect.gpu_for_device: the product number, the form factor,
the memory within 10%), so that a probe or a step-time calibration is used only for the GPU it
measured (issue #41). torch's `get_device_name` is nvidia-smi's product name; its `total_memory`
is the device's memory as nvidia-smi's `memory.total` counts it (e.g. 81,559 MiB on an H100 SXM).
"""

from __future__ import annotations

from memfit.estimate.models import catalog, detect

CPU = "cpu"  # the catalog's host entry, and the device name memfit.train.device_info records for it


def catalog_name(device_name: str, total_bytes: int | None) -> str:
    """The catalog GPU a measured device is (`cpu` for the host). Raises detect.DetectError
    when the catalog has no entry for it."""
    if device_name == CPU or device_name.startswith("cpu ("):  # "cpu (x86_64)": calibrations before #41
        return CPU
    return detect.gpu_for_device(device_name, int(total_bytes or 0) // 2**20)


def mismatch(device_name: str | None, total_bytes: int | None, gpu: str) -> str | None:
    """Why a measurement on `device_name` is not one of `gpu` (a catalog name), or None when it
    is: a clause without its subject ("ran on the CPU, not on h100-80gb")."""
    if not device_name:
        return "does not record the device it ran on"
    try:
        measured = catalog_name(device_name, total_bytes)
    except detect.DetectError as e:
        return f"ran on {device_name!r}, which is not {gpu} ({e})"
    if measured != gpu and measured != _canonical(gpu):
        on = "the CPU" if measured == CPU else f"{device_name} ({measured})"
        return f"ran on {on}, not on {gpu}"
    return None


def _canonical(gpu: str) -> str:
    """The catalog entry a configured name (or alias) is."""
    try:
        return catalog.gpu(gpu).name
    except (KeyError, ValueError):
        return gpu
