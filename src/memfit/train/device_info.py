"""Which device a rank really ran on, as its measurements record it (issue #41: measurements
belong to what they measured).

A probe (memfit.train.loop's summary) and a step-time calibration (memfit.train.calibrate) add
`device_identity()`: the name torch reports for the rank's device and its total memory. The
selection (memfit.estimate.selection) and the estimator's step-time pricing (memfit.estimate.time.timing)
match them to the configured catalog GPU (memfit.estimate.time.device_match) and refuse a measurement
of another device: on a machine without CUDA the launcher runs DeepSpeed on the CPU
(memfit.train.launch), and a probe of `gpus: [h100-80gb]` run there measured the CPU.
"""

from __future__ import annotations

from typing import Any

import torch

CPU = "cpu"  # the device name of the host (the catalog's `cpu` entry)


def device_identity(device: Any = None) -> dict[str, Any]:
    """{"device_name", "device_total_bytes"} of `device` (a torch.device or its string; None:
    the current CUDA device, else the CPU). A CUDA device: `torch.cuda.get_device_name` (the
    product name nvidia-smi shows, e.g. "NVIDIA H100 80GB HBM3") and
    `get_device_properties().total_memory`; the CPU: "cpu" and the host's physical memory."""
    dev = torch.device(device) if device is not None else None
    if dev is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev is not None and dev.type == "cuda":
        return {
            "device_name": torch.cuda.get_device_name(dev),
            "device_total_bytes": int(torch.cuda.get_device_properties(dev).total_memory),
        }
    import psutil  # a DeepSpeed dependency

    return {"device_name": CPU, "device_total_bytes": int(psutil.virtual_memory().total)}
