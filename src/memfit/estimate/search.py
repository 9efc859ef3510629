"""The largest value that fits: `fit` (the longest sequence or the largest micro batch;
`from memfit.estimate import fit`) over `largest_fitting` (doubling, then bisection, on
`core`'s estimate of one configuration), and the sequence-parallel sizes a job can split a
sequence over (`sequence_parallel_sizes`, `fit_sequence_parallel`). memfit.estimate.fit drives
the same search for `memfit fit`, with traces prefetched and progress lines."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from memfit.estimate.core import Estimate, Job, _estimate, _job_arch
from memfit.estimate.memory.method_terms import shape
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.models.catalog import GPU
from memfit.estimate.models.validity import model_problems
from memfit.estimate.settings import DEFAULT_SETTINGS, EstimateError, Settings
from memfit.space import Candidate

SEARCH_CAP = 2**34  # no bound given: the doubling stops here (17 billion tokens) and says so


# the smallest sequence `fit` and `memfit fit` (memfit.estimate.fit) search from: the next-token
# loss needs two tokens (trace.trace_key refuses fewer)
MIN_SEQ_LEN = 2


def smallest(maximize: str, cand: Candidate, method: str = "sft") -> int:
    """Where the search for the largest `maximize` starts: the method's fewest rows (one; KTO two),
    or the shortest sequence of which every rank of a Ulysses group holds MIN_SEQ_LEN tokens
    (`per_rank` rounds up)."""
    if maximize == "micro_batch":
        return shape(method).min_micro_batch
    return (MIN_SEQ_LEN - 1) * cand.sequence_parallel + 1


def fit(
    arch: ModelArch,
    gpu: GPU,
    num_gpus: int,
    num_nodes: int,
    method: str,
    cand: Candidate,
    maximize: str,
    host_memory_gb: float | None = None,
    budget_bytes: int | None = None,
    settings: Settings = DEFAULT_SETTINGS,
    upper: int | None = None,
    headroom: float | None = 0.0,
) -> tuple[int, Estimate | None]:
    """Binary search for the largest `maximize` value that fits with `headroom` kept free
    (memory grows monotonically in both), from `smallest` (2 tokens, as `memfit fit`; 1 row).
    Returns (0, the estimate at that smallest value) when even it does not fit or the hardware
    cannot run it."""
    if maximize not in ("seq_len", "micro_batch"):
        raise EstimateError(f"--maximize must be seq_len or micro_batch, got {maximize!r}")
    # seq_len: up to the model's context; a model that states none (Mamba) and the batch: 65,536
    hi = upper or ((arch.max_position_embeddings or 65536) if maximize == "seq_len" else 65536)
    job = Job(
        _job_arch(arch, method), gpu, num_gpus, num_nodes, method, host_memory_gb, budget_bytes, settings, headroom
    )

    def at(value: int) -> Estimate:
        return _estimate(job, dataclasses.replace(cand, **{maximize: value}))

    return largest_fitting(at, smallest(maximize, cand, method), hi)


def largest_fitting(at: Callable[[int], Estimate], lo: int, hi: int | None) -> tuple[int, Estimate]:
    """The largest value in [lo, hi] whose estimate fits with headroom (0 and the estimate at lo
    when none does); hi None: doubling from lo until a value does not fit (or SEARCH_CAP)."""
    first = at(lo)
    if first.invalid or not first.fits_with_headroom:
        return 0, first
    best, good = lo, first
    if hi is None:
        hi = lo
        while True:
            hi = min(hi * 2, SEARCH_CAP)
            e = at(hi)
            if not e.fits_with_headroom:
                break
            best, good = hi, e
            if hi == SEARCH_CAP:
                return hi, e
    else:
        top = at(hi)
        if top.fits_with_headroom:
            return hi, top
    while hi - best > 1:
        mid = (best + hi) // 2
        e = at(mid)
        if e.fits_with_headroom:
            best, good = mid, e
        else:
            hi = mid
    return best, good


def sequence_parallel_sizes(arch: ModelArch, world: int) -> list[int]:
    """The Ulysses group sizes a job can use: divisors of its ranks its heads split into."""
    return [
        sp
        for sp in range(1, world + 1)
        if world % sp == 0 and not model_problems(arch, Candidate(sequence_parallel=sp))
    ]


def fit_sequence_parallel(
    arch: ModelArch, gpu: GPU, num_gpus: int, num_nodes: int, method: str, cand: Candidate, **kwargs
) -> dict[int, int]:
    """The longest sequence that fits at every usable sequence-parallel size (`fit` per size),
    the answer to "how many GPUs must split a sequence of this length": {SP: seq_len}."""
    world = num_gpus * num_nodes
    return {
        sp: fit(
            arch, gpu, num_gpus, num_nodes, method, dataclasses.replace(cand, sequence_parallel=sp), "seq_len", **kwargs
        )[0]
        for sp in sequence_parallel_sizes(arch, world)
    }
