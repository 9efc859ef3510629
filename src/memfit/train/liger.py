"""The `kernels: liger` lever (RunConfig.kernels, docs/speed.md): Liger-Kernel's Triton kernels in
memfit's trainer.

What changes (Hsu et al. 2024, "Liger Kernel: Efficient Triton Kernels for LLM Training",
arXiv:2410.10989; the liger-kernel package, `pip install '.[liger]'`):
- RMSNorm, RoPE and SwiGLU: Liger's own per-model patch of the model instance
  (`liger_kernel.transformers.monkey_patch._apply_liger_kernel_to_instance`, which calls
  `apply_liger_kernel_to_<model_type>`, e.g. `apply_liger_kernel_to_llama`), with its loss patches
  off: memfit's loss code stays in charge.
- The head and the loss: per-token log p(label) from Liger's fused linear cross-entropy
  (`liger_kernel.ops.fused_linear_cross_entropy.fused_linear_cross_entropy_forward`, reduction
  "none": its per-token losses are -log p), so SFT's mean NLL and DPO's summed log-probabilities
  are computed by memfit exactly as with `loss_impl: full`, without the full logits. `LigerHead`
  replaces the head module's forward while active, as memfit's chunked head does
  (memfit.train.vocab_loss.ChunkedHead), so DeepSpeed ZeRO-3's hooks gather the head's weight
  around that call; the backward recomputes each chunk's logits gradient with the upstream
  per-token gradient folded in (`token_grad_output`, Liger's own reduction="none" backward), reading
  the weight from the parameter itself, which ZeRO-3 gathers again for the head's backward,
  never from a tensor saved at the forward (ZeRO-3 frees the gathered weight after it).

Where it runs: on a CUDA GPU with the liger-kernel package. On the CPU only under Triton's
interpreter (TRITON_INTERPRET=1 in the environment before anything imports Triton): the same
kernels, executed in numpy, for tests; far slower. Two gaps of Triton 3.9's interpreter are bridged
there (`_bridge_interpreter`), neither touching Liger's code: a Python float kernel argument is
passed as an fp32 scalar, as compiled Triton specializes it (triton/runtime/jit.py `mangle_type`:
float -> "fp32"; the interpreter's `_implicit_cvt` leaves it a Python float, so Liger's RMSNorm
`eps.to(...)` fails), and libdevice's `rsqrt` (a stub the CUDA backend resolves to
`__nv_rsqrtf`) runs as `tl.math.rsqrt`.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch
from torch import nn

from memfit.data import IGNORE_INDEX
from memfit.train.vocab_loss import HeadTargets


def interpreted() -> bool:
    """True where Liger's kernels run under Triton's interpreter: no CUDA GPU and TRITON_INTERPRET=1."""
    return not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1"


def problem(model_path: str) -> str | None:
    """Why `kernels: liger` cannot run here, or None; checked before anything loads. Reads the model's
    config.json (`model_path`: the directory with it) for its model type."""
    if why := runtime_problem():
        return why
    model_type = json.loads((Path(model_path) / "config.json").read_text()).get("model_type")
    return model_problem(model_type, f"{model_path}/config.json")


def installed() -> bool:
    """Whether the liger-kernel package and Triton are importable here."""
    return all(importlib.util.find_spec(p) is not None for p in ("liger_kernel", "triton"))


def runtime_problem() -> str | None:
    """Why this machine cannot run Liger's kernels (the package, a CUDA GPU), or None."""
    missing = [p for p in ("liger_kernel", "triton") if importlib.util.find_spec(p) is None]
    if missing:
        return (
            f"kernels: liger needs the liger-kernel package (not installed: {', '.join(missing)}); "
            "pip install '.[liger]' on a CUDA machine, or set kernels: none"
        )
    if not torch.cuda.is_available() and not interpreted():
        return (
            "kernels: liger needs a CUDA GPU (Liger-Kernel's kernels are Triton GPU kernels; on the CPU "
            "they run only under Triton's interpreter, TRITON_INTERPRET=1, for tests); set kernels: none"
        )
    return None


def model_problem(model_type: str | None, where: str) -> str | None:
    """Why Liger has no kernels for `model_type` (its per-model patch table,
    liger_kernel.transformers.monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN), or None; `where` names
    where the model type comes from. Needs the package (`installed`)."""
    _import_liger()
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return (
            f"kernels: liger has no kernels for model type {model_type!r} ({where}; "
            f"Liger-Kernel covers {', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}); set kernels: none"
        )
    return None


def refuse(kernels: str, model_path: str) -> None:
    """With `kernels` liger: RunRefused (`memfit launch` exits 2 with its message) when `problem`
    names one; nothing for kernels none."""
    from memfit.train.run_config import RunRefused

    if kernels == "liger" and (why := problem(model_path)):
        raise RunRefused(why)


def _bridge_interpreter() -> None:
    """Triton interpreter only: pass float kernel arguments as fp32 scalars and run libdevice's rsqrt
    as tl.math.rsqrt (the module docstring says why); before Liger's modules import `rsqrt`."""
    import numpy as np
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime import interpreter

    if getattr(interpreter._implicit_cvt, "memfit_bridge", False):
        return
    convert = interpreter._implicit_cvt

    def implicit_cvt(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return convert(arg)

    def rsqrt(x):
        return tl.math.rsqrt(x)

    implicit_cvt.memfit_bridge = True  # type: ignore[attr-defined]
    interpreter._implicit_cvt = implicit_cvt
    libdevice.rsqrt = rsqrt


def _import_liger() -> None:
    """Import Liger, under the interpreter after bridging its gaps: every import of Liger in memfit
    goes through here (Liger's modules bind libdevice's `rsqrt` when they are first imported)."""
    if interpreted():
        _bridge_interpreter()
    import liger_kernel.transformers  # noqa: F401


def apply(model: nn.Module) -> str:
    """Patch `model` (a HF causal LM, possibly peft-wrapped) with Liger's RMSNorm, RoPE and SwiGLU,
    and return a log line saying what was patched. The loss is memfit's (`LigerHead`)."""
    _import_liger()
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    _apply_liger_kernel_to_instance(
        base, rms_norm=True, rope=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
    )
    counts = patched(base)
    where = "Triton interpreter (CPU, tests only)" if interpreted() else "CUDA"
    return (
        f"kernels: liger ({where}): RMSNorm x{counts['rms_norm']}, SwiGLU x{counts['swiglu']}, RoPE "
        f"({counts['rope']}), the loss through Liger's fused linear cross-entropy"
    )


def snapshot(model: nn.Module):
    """A function that puts back the model's transformers module (e.g. modeling_llama) as it is now:
    `apply` also replaces that module's rotary function and its RMSNorm and MLP classes, which every
    model built later in the process would pick up (the calibration builds engines with and without
    Liger one after another: memfit.train.calibrate)."""
    import sys

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    module = sys.modules[type(base).__module__]
    saved = dict(vars(module))

    def restore() -> None:
        for name, value in saved.items():
            if getattr(module, name, None) is not value:
                setattr(module, name, value)

    return restore


def patched(model: nn.Module) -> dict[str, object]:
    """What Liger has patched in `model`: RMSNorm and SwiGLU modules running Liger's forward, and the
    module-level rotary function of the model's transformers module (e.g. modeling_llama)."""
    import sys

    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    def runs(m: nn.Module, fn) -> bool:
        return getattr(m.forward, "__func__", None) is fn

    rms = sum(runs(m, LigerRMSNorm.forward) for m in model.modules())
    swiglu = sum(runs(m, LigerSwiGLUMLP.forward) for m in model.modules())
    module = sys.modules.get(type(model).__module__)
    rope_fn = getattr(module, "apply_rotary_pos_emb", None)
    rope = "liger" if getattr(rope_fn, "__module__", "").startswith("liger_kernel") else "unchanged"
    return {"rms_norm": rms, "swiglu": swiglu, "rope": rope}


class _LigerLogProbs(torch.autograd.Function):
    """log p(target) per row of `hidden` [N, H] under the linear head (weight [V, H], bias), through
    Liger's fused linear cross-entropy with reduction "none"."""

    @staticmethod
    def forward(ctx, hidden, targets, weight, bias, softcap):
        from liger_kernel.ops.fused_linear_cross_entropy import fused_linear_cross_entropy_forward

        loss = fused_linear_cross_entropy_forward(
            hidden, weight, targets, bias=bias, reduction="none", softcap=softcap, compute_gradients=False
        )[0]
        ctx.save_for_backward(hidden, targets)
        # the parameters themselves, not saved tensors: ZeRO-3 gathers them again for the backward
        ctx.weight, ctx.bias, ctx.softcap = weight, bias, softcap
        return -loss

    @staticmethod
    def backward(ctx, grad_out):
        from liger_kernel.ops.fused_linear_cross_entropy import fused_linear_cross_entropy_forward

        hidden, targets = ctx.saved_tensors
        want_w = ctx.needs_input_grad[2]
        out = fused_linear_cross_entropy_forward(
            hidden.detach(),
            ctx.weight.detach(),
            targets,
            bias=None if ctx.bias is None else ctx.bias.detach(),
            reduction="none",
            softcap=ctx.softcap,
            token_grad_output=-grad_out.float(),  # d(-loss): the per-token upstream gradient of log p
            compute_gradients=True,
            weight_requires_grad=want_w,
        )
        grad_hidden, grad_w, grad_b = out[4], out[5], out[6]
        return (
            grad_hidden if ctx.needs_input_grad[0] else None,
            None,
            grad_w if want_w else None,
            grad_b if ctx.needs_input_grad[3] else None,
            None,
        )


def liger_token_logps(
    hidden: torch.Tensor, labels: torch.Tensor, head: nn.Linear, softcap: float | None = None, shifted: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log p(label) and the scored mask: the contract of
    `memfit.train.losses.token_logps(head(hidden), labels, shifted)` (fp32 [B, T - 1], 0 where not
    scored; [B, T] `shifted`). Only scored positions go through the head."""
    if not shifted:
        labels, hidden = labels[:, 1:], hidden[:, :-1]
    mask = labels != IGNORE_INDEX
    out = torch.zeros(labels.shape, dtype=torch.float32, device=hidden.device)
    h = hidden[mask].contiguous()
    if h.shape[0] == 0:
        return out + 0.0 * hidden.sum(-1).float(), mask  # keep the graph connected
    logps = _LigerLogProbs.apply(h, labels[mask].contiguous(), head.weight, head.bias, softcap)
    return out.masked_scatter(mask, logps), mask


class LigerHead(HeadTargets):
    """`memfit.train.vocab_loss.HeadTargets` over Liger's fused linear cross-entropy: inside
    `with LigerHead(model).targets(labels):` the model's forward returns, as `.logits`, the fp32
    log-probs of `labels`, and `.mask` the scored tokens."""

    def __init__(self, model: nn.Module, chunk_tokens: int | None = None) -> None:
        del chunk_tokens  # Liger sizes its own chunks (ops/fused_linear_cross_entropy.py)
        _import_liger()
        head = model.get_output_embeddings()
        if type(head) is not nn.Linear:
            raise ValueError(
                f"kernels: liger needs the model's output head to be a plain linear layer, got "
                f"{type(head).__name__} (lm_head among lora_targets?); set kernels: none"
            )
        cfg = getattr(model, "config", None)
        text_cfg = getattr(cfg, "get_text_config", lambda: cfg)() if cfg is not None else None
        self.softcap = getattr(text_cfg, "final_logit_softcapping", None) or None
        super().__init__(head)

    def _logps(self, hidden: torch.Tensor, labels: torch.Tensor, shifted: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return liger_token_logps(hidden, labels, self.head, self.softcap, shifted)
