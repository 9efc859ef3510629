"""What training and probes read from a prepared dataset: a split's rows (`load_split`), the
longest rows (`worst_case_batch`), and SFT packing of rows into sequences (`pack`)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from memfit.data.preparation import longest_first


def load_split(out_dir: str | os.PathLike, split: str) -> list[dict]:
    """Rows of `train` or `eval` as dicts of python ints/lists, in file order."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    return pq.read_table(Path(out_dir) / f"{split}.parquet").to_pylist()


def pack(lengths: list[int] | np.ndarray, capacity: int, seed: int) -> list[list[int]]:
    """SFT packing: row indices grouped into packs of at most `capacity` tokens in all.

    Best-fit decreasing (TRL's default `packing_strategy="bfd"`, SFTConfig docs:
    https://huggingface.co/docs/trl/sft_trainer#packing): rows, longest first, each go into the
    open pack with the least room that still holds them, else into a new pack. Rows are never
    cut or split across packs. Ties in length are ordered by a permutation drawn from `seed`, so
    the same (lengths, capacity, seed) always gives the same packs. Within a pack rows keep their
    placement order; packs are numbered by creation (the trainer shuffles them per epoch).
    """
    import bisect

    lengths = np.asarray(lengths, dtype=np.int64)
    if capacity < 1:
        raise ValueError(f"capacity must be at least 1, got {capacity}")
    if len(lengths) and (lengths.max() > capacity or lengths.min() < 1):
        bad = int(np.argmax((lengths > capacity) | (lengths < 1)))
        raise ValueError(f"row {bad} has {int(lengths[bad])} tokens; packing needs 1..{capacity}")
    perm = np.random.default_rng(seed).permutation(len(lengths))
    order = perm[np.argsort(-lengths[perm], kind="stable")]
    packs: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # (room left, pack index), sorted: open packs only
    for i in order.tolist():
        n = int(lengths[i])
        j = bisect.bisect_left(rooms, (n, -1))  # the smallest room >= n
        if j < len(rooms):
            room, k = rooms.pop(j)
        else:
            room, k = capacity, len(packs)
            packs.append([])
        packs[k].append(i)
        if room - n > 0:
            bisect.insort(rooms, (room - n, k))
    return packs


def worst_case_batch(out_dir: str | os.PathLike, micro_batch: int) -> list[dict]:
    """The `micro_batch` longest train rows, longest first (what a probe must survive).

    With fewer train rows than `micro_batch`, rows repeat (longest first) to fill the batch:
    memory depends on the shapes, and a probe needs the full batch shape.
    """
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be at least 1, got {micro_batch}")
    table = pq.read_table(Path(out_dir) / "train.parquet")
    order = longest_first(table["length"].to_numpy())
    picks = np.resize(order, micro_batch)  # np.resize repeats the array cyclically
    return table.take(pa.array(picks)).to_pylist()
