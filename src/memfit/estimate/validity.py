"""Which inputs the estimator can answer for: combinations the hardware cannot run (reported
with the reason) and architecture cards that lack what the formulas need (an error)."""

from __future__ import annotations

import dataclasses

from memfit.catalog import GPU, ModelArch
from memfit.estimate.settings import EstimateError
from memfit.space import Candidate

# The architecture sizes every formula uses: ModelArch's required integer fields (the card's
# sizes, as memfit.trace derives its own), less max_position_embeddings (only `fit`'s default
# upper bound for seq_len).
SIZE_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(ModelArch)
    if f.default is dataclasses.MISSING
    and f.type in ("int", int)
    and f.name != "max_position_embeddings"
)


def hardware_problems(gpu: GPU, cand: Candidate) -> list[str]:
    """Combinations the hardware cannot run (not estimated: reported with the reason)."""
    out = []
    is_cpu = gpu.name == "cpu"
    if cand.precision == "bf16" and not gpu.bf16:
        out.append(
            f"{gpu.name} has no bf16 support (compute capability {gpu.compute_capability}); use fp16 or fp32"
        )
    if cand.attn == "flash" and (is_cpu or not gpu.flash_attn2):
        sm = (
            "" if is_cpu else f" (needs sm80+, this is sm{gpu.compute_capability.replace('.', '')})"
        )
        out.append(f"FlashAttention-2 does not run on {gpu.name}{sm}; use sdpa or eager")
    if cand.finetune == "qlora" and is_cpu:
        out.append("QLoRA's bitsandbytes 4-bit kernels need a CUDA GPU; use lora on cpu")
    if (cand.offload_optimizer != "none" or cand.offload_param != "none") and is_cpu:
        out.append(
            "offloading to the host from the host (gpu=cpu) has no meaning; use offload none"
        )
    return out


def check_arch(arch: ModelArch) -> None:
    """Raise EstimateError naming every size field the card lacks (or has non-positive)."""
    missing = [
        f
        for f in SIZE_FIELDS
        if not isinstance(getattr(arch, f, None), int) or getattr(arch, f) <= 0
    ]
    if missing:
        raise EstimateError(
            f"model {arch.name!r} lacks {', '.join(missing)}: the estimate needs them"
        )
