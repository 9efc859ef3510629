"""Reserved memory of PyTorch's CUDA caching allocator at a training step's peak, from its mechanisms.

`torch.cuda.max_memory_reserved` is the high-water mark of the segments the allocator has taken
from cudaMalloc. It exceeds the allocated peak where a freed block stays cached but cannot serve
a later request (c10/cuda/CUDACachingAllocator.cpp, PyTorch 2.x):

- rounding: requests round up to 512 B (`kMinBlockSize`); requests under 1 MiB (`kSmallSize`)
  come from 2 MiB segments (`kSmallBuffer`), 1-10 MiB from 20 MiB ones (`kLargeBuffer`), larger
  ones round up to 2 MiB (`kRoundLarge`). A few MiB per process: `SEGMENT_ROUNDING`.
- splitting: a cached large block serves a smaller request by being split (`get_free_block`,
  `alloc_found_block`; no `max_split_size_mb` by default). When a step's largest transient is
  freed, the next step's smaller allocations are carved out of its segment, and the same large
  request next time finds no block big enough: a fresh segment, the old one stays reserved
  (the "largest transients" below). Freed memory is returned only when a cudaMalloc fails
  (`release_cached_blocks`), so reserved is a high-water mark across steps.
- per-stream pools: a cached block is reused only by the stream it was allocated on
  (`get_free_block` skips `block->stream != p.stream()`); DeepSpeed ZeRO-3 gathers parameters on
  its own all-gather stream (partition_parameters.py `get_allgather_stream`), so at world > 1
  those blocks stay reserved beside the optimizer step's allocations on the compute stream.
- expandable_segments (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, PyTorch >= 2.1): one
  segment per stream grows and unmaps pages in 2 MiB steps, so a large request after a split
  extends the segment instead of taking a fresh one: no split waste (PyTorch docs, "CUDA
  semantics: optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF").

Which transient is cached and re-requested where the peak is:
- the loss backward (LoRA, checkpointing, long sequences): the fp32 [t, V] logits block
  (log_softmax's output and its gradient, `held_logits.fp32_logits_block`). Freed after
  the loss, the next forward's 16-bit [t, V] logits (half its bytes) are carved out of it, so the
  next fp32 request takes a fresh segment and the other half stays cached: `LOGITS_CACHED_SHARE`
  of the block by default, the GPU's measured share where a calibration has one.
- the optimizer step (full fine-tuning, ZeRO-0/1/2/3 on the device): DeepSpeed flattens the
  16-bit gradients into a new tensor and converts it to fp32 (stage_1_and_2.py and stage3.py
  `flatten(...).to(fp32)`; ZeRO-0 bf16 builds one more fp32 copy, `states.step_grads`); the
  copies freed before the update (`step_grads - update_grads`) are cached and split by the next
  step's activations, and the next step's flatten takes a fresh segment. Measured on an H100 and
  an H200 (Llama-3.1-8B with 4 layers, 1.92e9 parameters, bf16): reserved - allocated 3.82 GB at
  ZeRO-2 (the 16-bit copy, 2 bytes per parameter: 3.84) and 7.68 GB at ZeRO-0 (4 bytes: 7.69),
  benchmarks/results/gpu_evidence_h100-80gb.json and _h200.json.

With batches of varying length (`Settings.variable_length`) the cached activation blocks of a
longer step are split by a shorter one's: no measured row has it, so the estimator's earlier
stated heuristic stays for it unchanged (`overheads.fragmentation`: 30% of the shape-varying bytes,
plus the whole fp32 logits block, `overheads.cached_logits_block`).
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.estimate.memory.overheads import fragmentation
from memfit.estimate.memory.phases import FORWARD_BACKWARD, StepPhases
from memfit.estimate.memory.states import ModelStates
from memfit.estimate.settings import Settings
from memfit.space import Candidate
from memfit.units import MIB

K_ROUND_LARGE = 2 * MIB  # c10/cuda/CUDACachingAllocator.cpp kRoundLarge: large segments round to 2 MiB
K_SMALL_BUFFER = 2 * MIB  # kSmallBuffer: the segment small (< 1 MiB) blocks are carved from
# rounding of a training process's segments: the small pool's partly used 2 MiB segment and the
# last large segment's 2 MiB rounding (CUDACachingAllocator.cpp `get_allocation_size`)
SEGMENT_ROUNDING = K_SMALL_BUFFER + K_ROUND_LARGE
# the share of the fp32 logits block left cached when the next forward's 16-bit logits (2 of its
# 4 bytes per element) are carved out of it: 0.5 (the mechanism in the module docstring; not
# fitted: the H100 and H200 rows measured 0.44-0.91, median 0.66, kept in their calibration files)
LOGITS_CACHED_SHARE = 0.5


@dataclass
class Reserved:
    """The reserved peak and the terms above the allocated peak that make it."""

    bytes: int
    phase: str  # the phase whose reserved segments are the most ("forward_backward" or "optimizer_step")
    # the terms above the allocated bytes of that phase (not always the allocated peak's phase):
    # logits_cached, variable_length, step_cached, side_stream, rounding
    terms: dict[str, int]


def round_segment(n: int) -> int:
    """Bytes rounded up to the allocator's 2 MiB large-segment granularity (kRoundLarge)."""
    return -(-n // K_ROUND_LARGE) * K_ROUND_LARGE


def reserved(
    phases: StepPhases,
    states: ModelStates,
    cand: Candidate,
    world: int,
    logits_block: int,
    transient: int,
    settings: Settings,
    logits_share: float | None = None,
) -> Reserved:
    """Peak reserved bytes: the larger of the forward/backward's segments (its allocated peak plus
    the cached logits remainder) and the optimizer step's (its allocated peak plus the flat
    gradient copies cached from the step before and, at ZeRO-3 on several ranks, the all-gather
    stream's pool), rounded to segments. `logits_share`: a calibration's measured share of the
    fp32 logits block that stays cached (None: LOGITS_CACHED_SHARE). `transient`: the
    shape-varying bytes (activations and logits) the variable-length term is a share of."""
    alloc = phases.allocated
    fb = max((alloc[k] for k in FORWARD_BACKWARD if k in alloc), default=0)
    expandable = settings.expandable_segments
    share = LOGITS_CACHED_SHARE if logits_share is None else logits_share
    logits_cached = 0 if expandable else int(share * logits_block)
    step_cached = 0
    if not expandable and states.update_grads is not None and states.step_grads > states.update_grads:
        step_cached = states.step_grads - states.update_grads
    side_stream = states.gathered if cand.zero == 3 and world > 1 else 0
    variable = fragmentation(transient, settings, False) if settings.variable_length else 0
    if settings.variable_length and not expandable:
        # not measured: the stated heuristic kept whole (overheads.fragmentation's share of the
        # shape-varying bytes plus the whole fp32 logits block, overheads.cached_logits_block)
        logits_cached = logits_block
    fb_reserved = fb + logits_cached + variable
    step_reserved = alloc.get("optimizer_step", 0) + step_cached + side_stream
    others = max((v for k, v in alloc.items() if k not in FORWARD_BACKWARD and k != "optimizer_step"), default=0)
    top = max(fb_reserved, step_reserved, others)
    phase = "optimizer_step" if top == step_reserved and step_reserved > fb_reserved else "forward_backward"
    total = round_segment(top) + SEGMENT_ROUNDING
    terms = {
        "logits_cached": logits_cached if phase == "forward_backward" else 0,
        "variable_length": variable if phase == "forward_backward" else 0,
        "step_cached": step_cached if phase == "optimizer_step" else 0,
        "side_stream": side_stream if phase == "optimizer_step" else 0,
    }
    terms["rounding"] = total - top
    return Reserved(total, phase, terms)
