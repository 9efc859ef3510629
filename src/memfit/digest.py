"""SHA-256 of files, streamed, and the stat fields that say a file is unchanged since it was hashed.

One implementation for the two places memfit identifies files by content: a run's inputs
(memfit.train.identity: the model, the reference, the prepared data) and a checkpoint's files
(memfit.train.checkpoint_digest: the manifest checked before any load)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

BLOCK_BYTES = 8 << 20  # 8 MiB per read: one reused buffer, no per-block allocation


def sha256_file(path: str | Path) -> str:
    """The file's SHA-256 (hex), read `BLOCK_BYTES` at a time into one buffer."""
    h = hashlib.sha256()
    buf = bytearray(BLOCK_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def stat_signature(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """(device, inode, size, mtime ns, ctime ns): any write to the file changes its ctime (which no
    user call can set back), and a copy or a re-save gets another inode, so an unchanged signature
    means unchanged bytes for a digest computed under it."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
