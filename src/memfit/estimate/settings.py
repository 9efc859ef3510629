"""What the estimator takes besides the candidate (`Settings`), how it reports bad input, and
the one dtype size every module uses."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    """Everything besides the candidate that changes memory. Defaults follow what memfit's
    trainer writes (`dsconfig.build`): DeepSpeed defaults, with the bucket sizes scaled to the
    model (`dsconfig.bucket_sizes`, HF's resolution of "auto") when `scaled_buckets`."""

    scaled_buckets: bool = True  # bucket sizes = h*h (dsconfig.bucket_sizes); False: DS defaults
    reduce_bucket_size: int | None = None  # elements; None: from scaled_buckets
    stage3_prefetch_bucket_size: int | None = None  # elements gathered ahead of use (ZeRO-3)
    stage3_max_live_parameters: int = 1_000_000_000  # DS default (runtime/zero/config.py)
    stage3_max_reuse_distance: int = 1_000_000_000  # DS default (runtime/zero/config.py), elements
    # parameters with fewer elements stay gathered on every rank (ds_persist); None: 10*h when
    # scaled_buckets (dsconfig.bucket_sizes, HF "auto"), else DeepSpeed's default 1e5
    stage3_param_persistence_threshold: int | None = None
    # whose runtime shards the stage-3 run: "deepspeed" (memfit's trainer) or "fsdp" (PyTorch
    # FSDP FULL_SHARD, for comparing with runs of other stacks): which parameters stay gathered
    # (`zero3.zero3_gathered_bytes`) and whether frozen linears keep their inputs
    # (`activation_memory.zero3_linear_inputs`, DeepSpeed's patched F.linear)
    zero3_impl: str = "deepspeed"
    # whose step runs a stage-0 (unpartitioned) candidate: "deepspeed" (memfit's trainer: the
    # engine's flattened all-reduce and, in 16-bit, FP16_Optimizer's fp32 gradient copies,
    # `states._stage0`) or "torch" (a plain torch optimizer on the parameters' own gradients:
    # the coverage harness, and stage-0 rows of trainers without DeepSpeed)
    zero0_engine: str = "deepspeed"
    sub_group_size: int = 1_000_000_000  # DS default; ZeRO-3 optimizer sub-group, elements
    overlap_comm: bool | None = None  # None: as dsconfig writes it (stage >= 2)
    lora_targets: tuple[str, ...] | None = None  # None: every linear of the decoder layer
    lora_alpha_dropout: bool = False  # lora_dropout > 0 saves a dropout mask+output per target
    # QLoRA: the non-quantized params stay in fp32 after peft's prepare_model_for_kbit_training
    # (HF Trainer); False: DeepSpeed casts them back to the training dtype (memfit's trainer)
    qlora_fp32_upcast: bool = False
    expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    variable_length: bool = True  # batches of varying length (fragmentation), False: padded
    # memfit's forwards of 2+ rows reach the attention with a mask: rows padded to the longest of
    # their batch (the probes' worst case padded to seq_len) and SFT packs alike (transformers
    # builds a block mask from the packs' position_ids, masking_utils
    # `find_packed_sequence_indices`); with sdpa, transformers then repeats K/V to every head, SDPA
    # saves them and its dtype copy of the mask (`padding_mask._padding_mask_extra`, the bool
    # mask once: `_padding_mask_once`). A forward of one row is never padded (the probe fills it
    # with its own tokens, memfit.train.batches.fill_row): no mask term whatever this says (a
    # packed micro batch of 1 included: the estimate does not know packing). False: full-length
    # rows, whose all-ones mask transformers drops (the public tables' runs, the traced step)
    padding_mask: bool = True
    optimizer_impl: str | None = None  # "fused" (DS FusedAdam), "foreach" or "single" (torch)
    mfu: float = 0.40  # model FLOPs utilisation of the GPU's dense peak (Chowdhery et al. 2022)
    # DeepSpeedCPUAdam (offload_optimizer: cpu), parameters per second per core, times the cores a rank
    # has: the default measured by benchmarks/bench_cpu_adam.py (50M fp32 parameters, one thread,
    # an AVX-512 Xeon, 2026-11-27: 5.4e8; 7.6e8 at 10M, in cache); DeepSpeed publishes no per-core
    # figure (ops/adam/cpu_adam.py: "5x to 7x speedup over torch.optim.adam(W)"). 4 cores per rank:
    # 8 ranks of a node then step at 1.7e10 parameters/s, about 480 GB/s of the node's memory (28
    # bytes a parameter), what a two-socket DDR5 node sustains; more cores stop helping there.
    # Workflow config: estimate.cpu_adam_params_per_s_per_core, estimate.cpu_cores_per_rank. Left at
    # these defaults, the rate the calibrate rule measured on the machine (`step_time_calibration`'s
    # `cpu_adam`, written when the search space offloads the optimizer) replaces them
    # (memfit.estimate.time.costs.cpu_adam).
    cpu_adam_params_per_s_per_core: float = 5.4e8
    cpu_cores_per_rank: int = 4
    internode_gbs: float = 25.0  # per-GPU inter-node bandwidth, GB/s (200 Gb/s InfiniBand)
    # a step-time calibration measured on the machine (memfit.train.calibrate's calibration.json):
    # step times from it (memfit.estimate.time.timing) instead of the assumed MFU; None: assumed
    step_time_calibration: str | None = None
    activations: str = "analytic"  # "analytic" (formulas) or "traced" (memfit.estimate.trace.trace, cached)
    trace_cache: str | None = None  # traced: cache directory (None: $MEMFIT_TRACE_CACHE or default)
    # How the trainer holds the [tokens, vocab] logits around its loss (memfit.estimate.
    # held_logits.held_logits): "memfit" (memfit's trainer drops the model output before
    # backward), "hf-model-fp32" (transformers <= 4.45), "hf-loss-function" (transformers >= 4.46
    # ForCausalLMLoss), "torchtune-held" (torchtune recipes without `del logits`).
    logits_handling: str = "memfit"
    # How a resumed run loads its optimizer state (`phases._resume`): "memfit" (memfit's trainer,
    # memfit.train.optimizer_load: copied into a state that exists) or "deepspeed" (DeepSpeed's
    # own `load_state_dict`, as OpenRLHF, TRL or HF Trainer on DeepSpeed run it: where the state
    # exists before the load, ZeRO-0 in 16-bit, it is held twice)
    trainer_loader: str = "memfit"
    nccl_bytes: int | None = (
        None  # NCCL communicator memory per GPU process (world > 1); None: overheads.NCCL_CUMEM_BYTES
    )
    loss_chunk_tokens: int | None = (
        None  # loss_impl chunked: tokens per chunk (None: 256 MiB of fp32 logits a chunk, vocab_loss.default_chunk_tokens)
    )
    mlp_tile_tokens: int | None = None  # tiled_mlp: tokens per sequence in a tile (None: the hidden size)
    # the prepared data's mean tokens per sequence (prepare_data's stats.json `length.mean`; for pairs
    # the prompt and the longer response): a padding_free candidate's step computes the rows' own
    # tokens, so its compute is priced on these (memfit.estimate.time.data_scale.data_scale);
    # None: on seq_len, the probes' worst case
    row_tokens: float | None = None
    # the prepared data's row lengths at p0..p100 (stats.json `length.quantiles`, nondecreasing; a
    # row's length is its longest sequence): a padded candidate's micro batch is padded to its
    # longest row, so its compute is priced on the expected longest of micro_batch rows
    # (memfit.estimate.time.data_scale.expected_longest); None: on seq_len, the probes' worst case
    row_length_quantiles: tuple[float, ...] | None = None


LOGITS_HANDLING = ("memfit", "hf-model-fp32", "hf-loss-function", "torchtune-held")
TRAINER_LOADERS = ("memfit", "deepspeed")

DEFAULT_SETTINGS = Settings()


class EstimateError(ValueError):
    """Bad input: unknown names, a config missing a field, an impossible combination."""


def dtype_bytes(precision: str) -> int:
    """Bytes per element of the training dtype: fp32 4, bf16/fp16 2."""
    return 4 if precision == "fp32" else 2
