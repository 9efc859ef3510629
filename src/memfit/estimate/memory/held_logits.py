"""The loss's logits beyond what memfit's own loss keeps: another trainer's handling of the [t, V]
logits (`held_logits`, `Settings.logits_handling`) and the largest fp32 logits block of a step
(`fp32_logits_block`, what the caching allocator must find in one piece). Split from
activation_memory along the seam between what autograd saves (there) and how the loss's
logits are held (here)."""

from __future__ import annotations

from memfit.estimate.memory.logits import chunk_tokens
from memfit.estimate.memory.method_terms import lm_head
from memfit.estimate.memory.micro_step import micro_step
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.settings import LOGITS_HANDLING, EstimateError, Settings
from memfit.space import Candidate


def held_logits(arch: ModelArch, cand: Candidate, method: str, settings: Settings) -> tuple[int, int]:
    """(loss forward's bytes beyond the loss backward's, bytes held through the backward) of the
    [t, V] logits under another trainer's loss code (`Settings.logits_handling`).

    memfit's trainer (default "memfit"): the model output is dropped before backward and the loss
    keeps log_softmax's fp32 output (see `activations`): nothing more.
    - "hf-model-fp32" (transformers <= 4.45 LlamaForCausalLM.forward): `logits = logits.float()`
      rebinds (the 16-bit tensor is freed, `.float()`'s backward saves nothing), the shifted
      `.contiguous()` copy and CrossEntropyLoss's log_softmax output: 12 t V in 16-bit training,
      no more than memfit's loss backward holds (4 + 8 t V). +0.
    - "hf-loss-function" (transformers >= 4.46): `LlamaForCausalLM.forward` keeps its 16-bit
      `logits` (d t V) while `self.loss_function` (loss/loss_utils.py `ForCausalLMLoss`) builds
      the fp32 upcast, the shifted `.contiguous()` copy and log_softmax's output:
      d + 4 + 4 + 4 t V at the loss forward (the upcast is a no-op in fp32 training), +2 t V
      over memfit's loss backward in bf16.
    - "torchtune-held": torchtune's recipes kept `logits` (fp32: TransformerDecoder's output
      `.float()`) referenced through `loss.backward()` and the optimizer step until the next
      forward rebinds it; torchtune later added `del logits  # free logits otherwise it peaks
      backward memory` (recipes/lora_finetune_single_device.py). +4 t V through the backward.
    Only for the full-vocabulary loss: `loss_impl=chunked` is memfit's own (memfit.train.vocab_loss).
    """
    impl = settings.logits_handling
    if impl not in LOGITS_HANDLING:
        raise EstimateError(f"logits_handling must be one of {LOGITS_HANDLING}, got {impl!r}")
    if impl == "memfit" or not lm_head(method):  # a reward model has no vocabulary logits
        return 0, 0
    if cand.loss_impl == "chunked":
        raise EstimateError(
            f"logits_handling={impl!r} describes another trainer's full-vocabulary loss; "
            "loss_impl=chunked is memfit's own loss (use logits_handling='memfit')"
        )
    step = micro_step(arch, cand, method, settings)
    tv, d = step.tokens * arch.vocab_size, step.dtype
    if impl == "hf-loss-function":
        return max(0, (d + (4 if d < 4 else 0) + 4 + 4) * tv - 12 * tv), 0
    if impl == "torchtune-held":
        return 0, 4 * tv
    return 0, 0  # hf-model-fp32


def fp32_logits_block(arch: ModelArch, cand: Candidate, method: str, settings: Settings) -> int:
    """The largest fp32 logits allocation of a step: [t, V] (log_softmax's output and its
    gradients), or one chunk's [c, V] with memfit's chunked loss (`chunked_loss_terms`)."""
    if not lm_head(method):  # a reward model's [t, 1] score: no logits block
        return 0
    step = micro_step(arch, cand, method, settings)
    t = step.tokens
    if cand.loss_impl == "chunked":
        t = chunk_tokens(arch, t, settings)
    return 4 * t * arch.vocab_size
