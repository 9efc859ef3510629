"""Which inputs the estimator can answer for: combinations the hardware cannot run (reported
with the reason) and architecture cards that lack what the formulas need (an error)."""

from __future__ import annotations

import dataclasses

from memfit.estimate.models.arch import ModelArch
from memfit.estimate.models.catalog import GPU
from memfit.estimate.models.params import fused_expert_weights, lora_adapts_experts
from memfit.estimate.settings import DEFAULT_SETTINGS, EstimateError, Settings
from memfit.space import Candidate

# The architecture sizes every formula uses: ModelArch's required integer fields (the card's
# sizes, as memfit.estimate.trace.trace derives its own), less max_position_embeddings (only `fit`'s default
# upper bound for seq_len).
SIZE_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(ModelArch)
    if f.default is dataclasses.MISSING and f.type in ("int", int) and f.name != "max_position_embeddings"
)


def hardware_problems(gpu: GPU, cand: Candidate) -> list[str]:
    """Combinations the hardware cannot run (not estimated: reported with the reason)."""
    out = []
    is_cpu = gpu.name == "cpu"
    if cand.precision == "bf16" and not gpu.bf16:
        out.append(f"{gpu.name} has no bf16 support (compute capability {gpu.compute_capability}); use fp16 or fp32")
    if cand.attn == "flash" and (is_cpu or not gpu.flash_attn2):
        sm = "" if is_cpu else f" (needs sm80+, this is sm{gpu.compute_capability.replace('.', '')})"
        out.append(f"FlashAttention-2 does not run on {gpu.name}{sm}; use sdpa or eager")
    if (cand.offload_optimizer != "none" or cand.offload_param != "none") and is_cpu:
        out.append("offloading to the host from the host (gpu=cpu) has no meaning; use offload none")
    return out


def model_problems(arch: ModelArch, cand: Candidate) -> list[str]:
    """What the model's transformers class cannot run (generic cards: read from the class), and
    a sequence-parallel size its heads do not split into (ulysses_sp.py UlyssesSPAttentionHF:
    query heads divisible by it, key/value heads dividing it or divisible by it)."""
    sp, heads, kv = cand.sequence_parallel, arch.num_attention_heads, arch.num_kv_heads
    if sp > 1 and (heads % sp or not (kv % sp == 0 or sp % kv == 0)):
        return [f"sequence_parallel {sp} does not split {arch.name}'s {heads} attention heads ({kv} key/value heads)"]
    if cand.tiled_mlp and (arch.is_moe or arch.generic):
        # memfit.train.long_context.tile_mlps tiles dense MLPs; the formulas model its saved input
        # for the hand-described dense cards (a traced card would need TiledMLP in the trace)
        what = "routes tokens to experts" if arch.is_moe else "is estimated from a trace, not the formulas"
        return [f"tiled_mlp is modelled for dense MLPs of the described architectures; {arch.name} {what}"]
    if not arch.generic:
        return []
    inv = arch.inventory()
    if cand.attn in inv.attn:
        return []
    return [
        f"{inv.class_name} implements no {cand.attn} attention in transformers "
        f"{_transformers_version()} (attn choices for it: {', '.join(inv.attn)})"
    ]


def _transformers_version() -> str:
    from importlib.metadata import version

    return version("transformers")


def unsupported_features(arch: ModelArch) -> list[str]:
    """Parts of an architecture the formulas do not model (refused, never guessed)."""
    out: list[str] = []
    if arch.generic:  # parameters from transformers' model, activations traced: nothing modelled
        return out
    if arch.uses_mla:
        out.append(
            f"multi-head latent attention (kv_lora_rank={arch.kv_lora_rank}, "
            f"q_lora_rank={arch.q_lora_rank}: modeling_deepseek_v3.DeepseekV3Attention): its "
            f"parameters are counted ({arch.num_params():,} in total) but the activation formulas "
            f"model only standard multi-head/grouped-query attention"
        )
    if arch.is_moe and arch.model_type not in MOE_MODELLED:
        out.append(
            f"mixture-of-experts model_type {arch.model_type!r}: the MoE activation formulas follow "
            f"{', '.join(MOE_MODELLED)} only"
        )
    return out


# MoE implementations whose routers and experts `activation_memory.moe_mlp_saved` follows.
MOE_MODELLED = ("mixtral", "qwen2_moe", "qwen3_moe")


def planning_notes(gpu: GPU, arch: ModelArch, cand: Candidate, settings: Settings = DEFAULT_SETTINGS) -> list[str]:
    """What the user should know about the hardware and the architecture: planning-only GPUs
    (catalog `GPU.planning_only`) and what the mixture-of-experts model leaves out."""
    out = []
    if gpu.planning_only:
        out.append(f"planning only: {gpu.planning_reason.strip()}")
    if cand.compile:
        # memfit.train.compile: regional compile of the decoder layers, priced as the eager layers.
        # Measured once on the CPU (2026-11-28, 2 ranks, demo model, ZeRO-0 fp32 full, sdpa, micro
        # batch 8 x 32 tokens, 4-step probes): the compiled peak equals the eager one to the byte
        # (71,683,344 B, at the backward; the estimate 72,391,680); larger layers, where inductor's
        # fused elementwise ops could save fewer intermediates, are not measured. Its time comes
        # from a calibration of the compiled engine (the calibrate rule compiles it), else as eager
        out.append(
            "compile: memory priced as the eager layers (equal on the demo model's CPU probe; larger layers not measured); "
            "step time from the calibration of the compiled engine, else as eager"
        )
    if cand.kernels == "liger":
        # memfit.estimate.memory.liger_terms and time.liger_time: Liger-Kernel 0.8.5's saved tensors and
        # memory traffic, from its source; the saved bytes measured on the CPU under Triton's
        # interpreter (tests/test_liger_memory.py, docs/speed.md); its GPU step time not measured here
        out.append(
            "kernels liger: memory priced from Liger-Kernel's saved tensors (RMSNorm, SwiGLU, fused linear "
            "cross-entropy; measured against the CPU interpreter's steps); step time from the calibration "
            "of the liger engine, else its fused ops' memory traffic on the roofline (not measured on a GPU); "
            "needs the liger-kernel package, a CUDA GPU and a model type Liger covers where it trains"
        )
    if arch.is_moe:
        out.append(
            f"mixture-of-experts: weights, gradients and optimizer states of all "
            f"{arch.num_params() / 1e9:.1f}B parameters (every expert), step FLOPs of the "
            f"{arch.num_active_params() / 1e9:.1f}B active per token; expert parallelism is not "
            f"supported (every rank holds a ZeRO share of every expert) and no tokens are dropped "
            f"(no capacity factor)"
        )
        if cand.finetune != "full":
            if lora_adapts_experts(arch, settings, cand.finetune):
                what = (
                    f"peft's all-linear adapts the attention, the router and the routed experts "
                    f"(target_parameters: gate_up_proj at rank 2r, down_proj at r), and keeps each "
                    f"layer's adapted expert weights (W + BA, {arch.num_experts} experts) for the "
                    f"backward; pass --lora-targets to leave the experts frozen"
                )
            else:
                what = (
                    "the adapted nn.Linear layers (attention, shared expert) only; the routed "
                    "experts and the router stay frozen"
                )
            if cand.finetune == "qlora" and fused_expert_weights(arch):
                what += "; the routed experts' fused weights in 4 bits like the linears (docs/qlora.md)"
            elif cand.finetune == "qlora":
                what += (
                    "; bitsandbytes quantizes nn.Linear only, so the experts stay unquantized "
                    "(in the training dtype: DeepSpeed casts back what prepare_model_for_kbit_training upcast)"
                )
            out.append(f"mixture-of-experts LoRA: {what}")
    return out


def check_arch(arch: ModelArch) -> None:
    """Raise EstimateError naming every size field the card lacks (or has non-positive), or the
    architecture feature the estimate does not model."""
    missing = [f for f in SIZE_FIELDS if not isinstance(getattr(arch, f, None), int) or getattr(arch, f) <= 0]
    if missing:
        raise EstimateError(f"model {arch.name!r} lacks {', '.join(missing)}: the estimate needs them")
    unsupported = unsupported_features(arch)
    if unsupported:
        raise EstimateError(f"model {arch.name!r} is not supported by the estimate: {'; '.join(unsupported)}")
