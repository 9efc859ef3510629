"""Byte units, one home: binary units as nvidia-smi and `free -h` print them."""

from __future__ import annotations

KIB = 2**10
MIB = 2**20
GIB = 2**30

# The host memory a rank maps beyond training's while memfit's trainer loads a checkpoint (files
# mapped, copied a chunk at a time, each chunk's pages released: memfit.train.stream_load). The
# trainer uses it and the estimator prices it (memfit.estimate.memory.overheads.host_memory). 64 MiB: large
# enough that a copy runs at memory bandwidth with one madvise(2) call per chunk.
CHECKPOINT_CHUNK_BYTES = 64 * MIB


def fmt_bytes(n: float) -> str:
    """Binary units a person reads at a glance: 85.0 MiB, 1.23 GiB."""
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def gib(n: float) -> str:
    """Always in GiB (for columns that compare sizes): 0.08 GiB, 1,234.50 GiB."""
    return f"{n / GIB:,.2f} GiB"
