"""What `memfit estimate` and `memfit fit` refuse before estimating anything: values that cannot be
meant (zero, negative, infinite, beyond a stated bound) and flags that would do nothing in the
setup the other flags describe. Each refusal is one sentence naming the flag (EstimateError: exit 2).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from memfit.estimate.memory.method_terms import SEQUENCE_PARALLEL_METHODS
from memfit.estimate.settings import EstimateError
from memfit.methods import REFERENCE_METHODS, shape

# The most GPUs one node holds: NVIDIA's largest single-node systems, DGX-2/HGX-2 (16 V100 on
# NVSwitch; the DGX-2 datasheet), hold 16; DGX/HGX A100, H100, H200 and B200 hold 8, and a rack
# such as GB200 NVL72 is 18 nodes of 4. More GPUs than this are more nodes: --num-nodes.
MAX_GPUS_PER_NODE = 16

# The largest micro batch memfit answers for: FlashAttention-2 launches its kernels on a grid of
# (query blocks, batch, heads) (flash_attn csrc flash_fwd_launch_template.h, `dim3 grid(num_m_block,
# params.b, params.h)`), and a CUDA grid's y dimension is at most 65,535 (CUDA C++ Programming Guide,
# "Technical Specifications per Compute Capability"), so a larger micro batch cannot launch there.
# Above it no run trains, so `fit --maximize micro_batch` stops at this bound and says so.
MAX_MICRO_BATCH = 65_535

# Flags given as defaults of None in the parser so that "given" can be told from "default".
SEQ_LEN_DEFAULT = 2048
MICRO_BATCH_DEFAULT = 1


def check_flags(args) -> None:
    """Refuse values that cannot be meant, and flags that would do nothing in this setup."""
    _check_numbers(args)
    _check_levers(args)
    _check_files(args)


def _check_numbers(args) -> None:
    floats = {
        "--host-memory-gib": args.host_memory_gib,
        "--host-memory-gb": args.host_memory_gb,
        "--budget-gib": args.budget_gib,
        "--budget-gb": args.budget_gb,
        "--headroom": args.headroom,
        "--offload-ratio": args.offload_ratio,
        "--nccl-mib": args.nccl_mib,
        "--cpu-adam-rate": args.cpu_adam_rate,
    }
    for flag, value in floats.items():
        if value is not None and not math.isfinite(value):
            raise EstimateError(f"{flag} must be a finite number, got {value:g}")
    positive = {
        "--num-gpus": args.num_gpus,
        "--num-nodes": args.num_nodes,
        "--seq-len": args.seq_len,
        "--micro-batch": args.micro_batch,
        "--grad-accum": args.grad_accum,
        "--global-batch": getattr(args, "global_batch", None),
        "--sequence-parallel": args.sequence_parallel,
        "--sub-group-size": args.sub_group_size,
        "--lora-rank": args.lora_rank,
        "--host-memory-gib": args.host_memory_gib,
        "--host-memory-gb": args.host_memory_gb,
        "--budget-gib": args.budget_gib,
        "--budget-gb": args.budget_gb,
        "--cpu-adam-rate": args.cpu_adam_rate,
        "--cpu-cores-per-rank": args.cpu_cores_per_rank,
    }
    for flag, value in positive.items():
        if value is not None and not value > 0:
            raise EstimateError(f"{flag} must be > 0, got {value:g}")
    if args.num_gpus > MAX_GPUS_PER_NODE and args.gpu != "cpu":
        raise EstimateError(
            f"--num-gpus {args.num_gpus} is more than one node holds (at most {MAX_GPUS_PER_NODE}, "
            "NVIDIA DGX-2/HGX-2); --num-gpus counts GPUs per node: give the nodes with --num-nodes"
        )
    if args.micro_batch is not None and args.micro_batch > MAX_MICRO_BATCH:
        raise EstimateError(
            f"--micro-batch {args.micro_batch} is above {MAX_MICRO_BATCH:,}, the largest micro batch "
            "memfit answers for (FlashAttention-2 puts the batch on CUDA's grid y dimension, at most "
            "65,535); use --grad-accum for larger batches"
        )
    if not 0.0 < args.offload_ratio <= 1.0:
        raise EstimateError(f"--offload-ratio must be in (0, 1], got {args.offload_ratio:g}")
    if args.headroom is not None and not 0.0 <= args.headroom < 1.0:
        raise EstimateError(f"--headroom must be in [0, 1), got {args.headroom:g}")
    if getattr(args, "global_batch", None) is not None and args.grad_accum is not None:
        raise EstimateError("give --global-batch or --grad-accum, not both (--global-batch sets each one's grad accum)")
    if args.host_memory_gib is not None and args.host_memory_gb is not None:
        raise EstimateError("give --host-memory-gib or --host-memory-gb (decimal GB), not both")
    if args.budget_gib is not None and args.budget_gb is not None:
        raise EstimateError("give --budget-gib or --budget-gb (decimal GB), not both")
    if args.nccl_mib is not None and args.nccl_mib < 0:
        raise EstimateError(f"--nccl-mib must be >= 0, got {args.nccl_mib:g}")
    if args.loss_chunk_tokens is not None and args.loss_chunk_tokens < 1:
        raise EstimateError(f"--loss-chunk-tokens must be >= 1, got {args.loss_chunk_tokens}")
    if args.mlp_tile_tokens is not None and args.mlp_tile_tokens < 1:
        raise EstimateError(f"--mlp-tile-tokens must be >= 1, got {args.mlp_tile_tokens}")


def _check_levers(args) -> None:
    """A flag whose lever is off, or that `fit` searches over, would be silently ignored."""
    maximize = getattr(args, "maximize", None)
    if maximize == "seq_len" and args.seq_len is not None:
        raise EstimateError("--seq-len does nothing with --maximize seq_len (fit searches it); drop --seq-len")
    max_seq_len = getattr(args, "max_seq_len", None)
    if max_seq_len is not None and maximize != "seq_len":
        raise EstimateError("--max-seq-len does nothing with --maximize micro_batch (it bounds the seq_len search)")
    if max_seq_len is not None and max_seq_len < 2:
        raise EstimateError(f"--max-seq-len must be >= 2 (the next-token loss needs two tokens), got {max_seq_len}")
    if maximize == "micro_batch" and args.micro_batch is not None:
        raise EstimateError(
            "--micro-batch does nothing with --maximize micro_batch (fit searches it); drop --micro-batch"
        )
    full = args.finetune in (None, "full")
    if full and args.lora_rank is not None:
        raise EstimateError("--lora-rank does nothing with --finetune full; use lora or qlora")
    if full and args.lora_targets:
        raise EstimateError("--lora-targets does nothing with --finetune full; use lora or qlora")
    if not shape(args.method).reference and args.ref is not None:
        raise EstimateError(
            f"--ref does nothing with --method {args.method}: {args.method} trains without a reference model "
            f"(only {' and '.join(REFERENCE_METHODS)} have one); drop --ref"
        )
    if args.method not in SEQUENCE_PARALLEL_METHODS and any(sp > 1 for sp in _values(args.sequence_parallel)):
        raise EstimateError(
            f"--sequence-parallel above 1 with --method {args.method}: memfit trains {args.method} without "
            f"sequence parallelism (only {' and '.join(SEQUENCE_PARALLEL_METHODS)} run under it); drop --sequence-parallel"
        )
    least = shape(args.method).min_micro_batch
    if any(mb < least for mb in _values(args.micro_batch)):
        raise EstimateError(
            f"--micro-batch below {least} with --method {args.method}: KTO's KL batch pairs each row with "
            f"another row's completion (TRL's KTOTrainer refuses 1, and so does memfit's trainer); use {least} or more"
        )
    if shape(args.method).head == "score" and "chunked" in _values(args.loss_impl):
        raise EstimateError(
            f"--loss-impl chunked does nothing with --method {args.method}: a reward model's score head "
            "has no vocabulary logits to chunk; drop --loss-impl"
        )
    if args.pin_memory and args.offload_optimizer in (None, "none") and args.offload_param in (None, "none"):
        raise EstimateError("--pin-memory does nothing without --offload-optimizer cpu or --offload-param cpu")
    if args.loss_chunk_tokens is not None and args.loss_impl != "chunked":
        raise EstimateError("--loss-chunk-tokens does nothing with --loss-impl full; add --loss-impl chunked")
    if args.row_tokens is not None and True not in _values(args.padding_free):
        raise EstimateError("--row-tokens does nothing without --padding-free; add --padding-free")
    if args.row_tokens is not None and args.row_tokens <= 0:
        raise EstimateError(f"--row-tokens must be a positive number of tokens, got {args.row_tokens:g}")
    if args.mlp_tile_tokens is not None and not args.tiled_mlp:
        raise EstimateError("--mlp-tile-tokens does nothing without --tiled-mlp; add --tiled-mlp")


def _check_files(args) -> None:
    cal = args.step_time_calibration
    if cal is not None:
        from memfit.estimate.time import timing

        if not Path(cal).is_file():
            raise EstimateError(f"--step-time-calibration {cal}: no such file")
        try:
            timing.load(cal)
        except (timing.CalibrationFileError, UnicodeDecodeError) as exc:
            raise EstimateError(f"--step-time-calibration {exc}") from None
    if args.trace_cache is not None:
        if args.activations != "traced":
            raise EstimateError("--trace-cache does nothing without --activations traced")
        cache = Path(args.trace_cache)
        try:
            cache.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise EstimateError(f"--trace-cache {cache}: cannot create it ({exc.strerror})") from None
        if not cache.is_dir() or not os.access(cache, os.W_OK):
            raise EstimateError(f"--trace-cache {cache}: not a writable directory")


# The levers' defaults where the flag is not given (cli_parser holds None for them); ZeRO's
# depends on the GPUs: `zero_default`.
LEVER_DEFAULTS = {
    "finetune": "full",
    "grad_ckpt": True,
    "attn": "flash",
    "loss_impl": "full",
    "precision": "bf16",
    "offload_optimizer": "none",
    "offload_param": "none",
    "sequence_parallel": 1,
    "padding_free": False,
    "compile": False,
    "kernels": "none",
}


def zero_default(args) -> int:
    """ZeRO-0 on one GPU of one node: nothing to partition, and memfit's H100 probes measured
    ZeRO-3 1.9x slower than ZeRO-0 there (0.189 vs 0.099 s a step, docs/gpus.md); ZeRO-3 on
    several GPUs, and wherever offload asks for it (optimizer offload needs ZeRO >= 1, parameter
    offload ZeRO-3)."""
    single = args.num_gpus * args.num_nodes == 1
    offload = args.offload_optimizer != "none" or args.offload_param != "none"
    return 0 if single and not offload else 3


def fill_defaults(args) -> None:
    """After the checks: the levers not given as the estimate reads them."""
    if args.seq_len is None:
        args.seq_len = SEQ_LEN_DEFAULT
    if args.micro_batch is None:  # KTO's KL batch needs 2 rows (memfit.methods.MethodShape.min_micro_batch)
        args.micro_batch = max(MICRO_BATCH_DEFAULT, shape(args.method).min_micro_batch)
    if args.grad_accum is None:
        args.grad_accum = 1
    for name, value in LEVER_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.zero is None:
        args.zero = zero_default(args)


def combinations(args, space_flags) -> list:
    """One namespace per combination of the list-valued levers (`space_flags`: their dests), each
    lever a single value or None (not given); one namespace when every list has one value."""
    import argparse
    import itertools

    axes = {d: (getattr(args, d) or [None]) for d in space_flags}
    out = []
    for values in itertools.product(*axes.values()):
        one = argparse.Namespace(**vars(args))
        for dest, value in zip(axes, values, strict=True):
            setattr(one, dest, value)
        out.append(one)
    return out


def check_space(combos: list) -> None:
    """`check_flags` over the combinations of a ranked search: a bad number or file is refused in
    any of them; a flag that does nothing only when it does nothing in every combination."""
    for args in combos:
        _check_numbers(args)
        _check_files(args)
    problems = []
    for args in combos:
        try:
            _check_levers(args)
        except EstimateError as exc:
            problems.append(exc)
    if len(problems) == len(combos):
        raise problems[0]


def search_bound(args, arch) -> tuple[int | None, str]:
    """`fit`'s upper bound and what sets it (None: memory alone, the search doubles until it stops
    fitting). seq_len: --max-seq-len; else the model's context (max_position_embeddings); with
    --allow-beyond-context, or for a model that states no context, memory. --max-seq-len beyond
    the context needs --allow-beyond-context. micro_batch: MAX_MICRO_BATCH."""
    if args.maximize != "seq_len":
        return MAX_MICRO_BATCH, "memfit's micro batch bound (CUDA's grid y dimension, FlashAttention-2)"
    context = arch.max_position_embeddings
    given = args.max_seq_len
    if given is not None:
        if context and given > context and not args.allow_beyond_context:
            raise EstimateError(
                f"--max-seq-len {given} is beyond {arch.name}'s context of {context} tokens "
                "(max_position_embeddings); pass --allow-beyond-context to search beyond it"
            )
        return given, "--max-seq-len"
    if context and not args.allow_beyond_context:
        return context, f"{arch.name}'s context (max_position_embeddings)"
    return None, "memory"


def _values(value) -> list:
    """A flag's values: none, one, or a ranked search's comma-separated list."""
    return [] if value is None else list(value) if isinstance(value, list | tuple) else [value]
