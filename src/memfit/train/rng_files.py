"""Per-rank RNG states in a checkpoint (rng.rank{r}.pt): written as tensors, numbers and strings
only and read back with weights_only=True, so that no code from a run folder runs; and the
reseeding of ranks whose saved states do not map (a resume on another number of ranks)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit.train.checkpoint_digest import CheckpointError, load_weights_only


def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors, numbers and strings only (torch.save'd, read back
    with weights_only=True): Python's Mersenne Twister (random.getstate: version, 625 words,
    gauss_next), NumPy's legacy state (np.random.get_state: name, 624 uint32 keys, pos,
    has_gauss, cached_gaussian), torch's and CUDA's generator bytes."""
    version, words, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state = {
        "python_version": int(version),
        "python_words": torch.tensor(words, dtype=torch.int64),
        "python_gauss": gauss,
        "numpy_name": str(name),
        "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "numpy_pos": int(pos),
        "numpy_has_gauss": int(has_gauss),
        "numpy_gauss": float(cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate((state["python_version"], tuple(state["python_words"].tolist()), state["python_gauss"]))
    keys = state["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state((state["numpy_name"], keys, state["numpy_pos"], state["numpy_has_gauss"], state["numpy_gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def load_rng_state(path: Path) -> None:
    """Restore this rank's RNG states from `path` (weights_only: no code from the file runs)."""
    state = load_weights_only(path, map_location="cpu")
    try:
        set_rng_state(state)
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise CheckpointError(f"{path} is not an RNG state memfit wrote ({type(e).__name__}: {e})") from e


def reseed(seed: int, step: int, rank: int) -> None:
    """Python, NumPy and torch (CUDA included) RNGs from (seed, step, rank): what a rank starts
    from after a resume on another number of ranks, where the saved per-rank states do not map."""
    value = int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)  # seeds every CUDA device too
