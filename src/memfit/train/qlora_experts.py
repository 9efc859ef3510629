"""QLoRA of mixture-of-experts models: the routed experts' fused 3-D weights in 4 bits.

transformers >= 5 stores the routed experts of an MoE layer as one module holding two 3-D
parameters, `gate_up_proj` (or `up_proj`) and `down_proj`, of shape (experts, out, in), or
(experts, in, out) where the class is declared `is_transposed` (gpt-oss); every such class is
decorated with `transformers.integrations.moe.use_experts_implementation`, which records its
layout on each instance (`has_gate`, `has_bias`, `is_transposed`, `has_post_expert_norm`).
bitsandbytes quantizes nn.Linear modules only (transformers' `Bnb4BitHfQuantizer
.param_needs_quantization`: `isinstance(module, bnb.nn.Linear4bit)`), so under plain QLoRA these
weights, most of an MoE model, stay in 16 bits.

`quantize_fused_experts` stores each expert's (out, in) matrix of those parameters exactly as
bitsandbytes stores a `Linear4bit` weight (`bitsandbytes.functional.quantize_4bit`: NF4 or FP4,
blocks of 64, double quantization of the absmax constants in blocks of 256), stacked per
parameter: `<name>_4bit` (experts, in*out/2 packed bytes, a frozen parameter), `<name>_absmax`
(experts, in*out/64 8-bit constants), `<name>_absmax2` (experts, ceil(in*out/64/256) fp32) and
`<name>_offset` (experts, fp32), and replaces the module's forward by a loop over the experts
the batch routes to (transformers' eager experts forward) in which each matmul is
bitsandbytes' `matmul_4bit` on that expert's packed weight (`MatMul4Bit`: the weight is
dequantized in the forward and again in the backward, and never saved, so autograd reaches the
inputs and nothing reaches the packed data). LoRA adapters elsewhere (attention, shared experts,
router) train with the experts frozen in 4 bits.
"""

from __future__ import annotations

import types

import torch
from torch import nn

BLOCKSIZE = 64  # bitsandbytes' default 4-bit block (functional.quantize_4bit), as for Linear4bit
EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")


def fused_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every experts module of `model` holding fused 3-D expert weights (a
    class decorated with transformers' `use_experts_implementation`), already quantized or not."""
    out = []
    for name, m in model.named_modules():
        if not hasattr(m, "is_transposed") or not hasattr(m, "has_gate"):
            continue
        if any(_is_fused(m, p) or hasattr(m, f"{p}_4bit") for p in EXPERT_WEIGHTS):
            out.append((name, m))
    return out


def _is_fused(m: nn.Module, name: str) -> bool:
    p = m._parameters.get(name)
    return p is not None and p.dim() == 3


def quantize_fused_experts(
    model: nn.Module, quant_type: str, compute_dtype: torch.dtype, quant_storage: torch.dtype = torch.uint8
) -> list[str]:
    """Quantize the fused expert weights of `model` in place, one parameter at a time (its 16-bit
    tensor is released as soon as its packed copy exists), on the device each one is on. Returns
    the qualified names of the quantized parameters."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    done = []
    for mod_name, m in fused_experts(model):
        if m.has_gate and not getattr(m, "is_concatenated", True) and type(m)._apply_gate is _default_gate():
            raise ValueError(
                f"{mod_name} ({type(m).__name__}): interleaved gate/up expert weights without the class's "
                "own _apply_gate; memfit cannot run these experts in 4 bits"
            )
        for pname in EXPERT_WEIGHTS:
            if not _is_fused(m, pname):
                continue
            w = m._parameters[pname].detach()
            if m.is_transposed:  # stored (experts, in, out): bitsandbytes packs (out, in) as nn.Linear does
                w = w.transpose(1, 2)
            packed, absmax, absmax2, offset, code2 = [], [], [], [], None
            for e in range(w.shape[0]):
                q, state = bnbf.quantize_4bit(
                    w[e].contiguous(),
                    blocksize=BLOCKSIZE,
                    compress_statistics=True,
                    quant_type=quant_type,
                    quant_storage=quant_storage,
                )
                packed.append(q.view(-1))
                absmax.append(state.absmax)
                absmax2.append(state.state2.absmax)
                offset.append(state.offset.reshape(1).float())
                code2 = state.state2.code
            out_f, in_f = w.shape[1], w.shape[2]
            del m._parameters[pname]
            del w
            # a bitsandbytes Params4bit (already quantized), as Linear4bit's weight is: peft's
            # prepare_model_for_kbit_training upcasts every other 16-bit parameter to fp32
            # (peft/utils/other.py: `param.__class__.__name__ != "Params4bit"`), which would
            # convert the packed bytes of a 16-bit quant_storage (ZeRO-3) as numbers
            data = bnb.nn.Params4bit(
                torch.stack(packed),
                requires_grad=False,
                blocksize=BLOCKSIZE,
                compress_statistics=True,
                quant_type=quant_type,
                quant_storage=quant_storage,
                bnb_quantized=True,
            )
            m.register_parameter(f"{pname}_4bit", data)
            m.register_buffer(f"{pname}_absmax", torch.stack(absmax))
            m.register_buffer(f"{pname}_absmax2", torch.stack(absmax2))
            m.register_buffer(f"{pname}_offset", torch.cat(offset))
            m.register_buffer("_absmax_code", code2, persistent=False)
            m.register_buffer("_nf4_code", bnbf.get_4bit_type(quant_type, device=code2.device), persistent=False)
            shapes = dict(getattr(m, "_4bit_shapes", {}))
            shapes[pname] = (out_f, in_f)
            m._4bit_shapes = shapes
            done.append(f"{mod_name}.{pname}")
        if any(n.startswith(f"{mod_name}.") for n in done):
            m._4bit_quant_type = quant_type
            m._4bit_compute_dtype = compute_dtype
            m.forward = types.MethodType(_experts_forward_4bit, m)
    return done


def _default_gate():
    from transformers.integrations.moe import _default_apply_gate

    return _default_apply_gate


def expert_state(m: nn.Module, pname: str, e: int):
    """bitsandbytes' QuantState of expert `e`'s matrix of parameter `pname` (what
    `quantize_4bit(..., compress_statistics=True)` returned for it)."""
    from bitsandbytes.functional import QuantState

    state2 = QuantState(
        absmax=getattr(m, f"{pname}_absmax2")[e].float(), code=m._absmax_code, blocksize=256, dtype=torch.float32
    )
    return QuantState(
        absmax=getattr(m, f"{pname}_absmax")[e],
        shape=torch.Size(m._4bit_shapes[pname]),
        code=m._nf4_code,
        blocksize=BLOCKSIZE,
        quant_type=m._4bit_quant_type,
        dtype=m._4bit_compute_dtype,
        offset=getattr(m, f"{pname}_offset")[e].float(),
        state2=state2,
    )


def dequantized(m: nn.Module, pname: str, e: int) -> torch.Tensor:
    """Expert `e`'s (out, in) matrix of `pname`, dequantized (for tests and inspection)."""
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_4bit(getattr(m, f"{pname}_4bit")[e].view(-1, 1), expert_state(m, pname, e))


def _expert_matmul(m: nn.Module, pname: str, e: int, x: torch.Tensor) -> torch.Tensor:
    """x @ W_e^T (+ bias_e) with W_e in 4 bits: bitsandbytes' `matmul_4bit`, as `Linear4bit`
    calls it (autograd/_functions.py `MatMul4Bit`: dequantize in the forward, again in the
    backward for the input's gradient; the packed weight gets no gradient)."""
    import bitsandbytes as bnb

    bias = m._parameters.get(f"{pname}_bias")
    out = bnb.matmul_4bit(x, getattr(m, f"{pname}_4bit")[e].view(-1, 1), quant_state=expert_state(m, pname, e))
    if bias is not None:
        out = out + bias[e].to(out.dtype)
    return out


def _experts_forward_4bit(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' eager experts forward (e.g. Qwen3MoeExperts.forward) over the 4-bit
    weights, for every layout `use_experts_implementation` describes (integrations/moe.py
    `batched_mm_experts_forward` reads the same attributes)."""
    final = torch.zeros_like(hidden_states)
    up = "gate_up_proj" if self.has_gate else "up_proj"
    with torch.no_grad():
        # num_classes E + 1: an expert-parallel sentinel index E is skipped, as upstream
        mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit[:, 0].tolist():
        if e == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(mask[e])
        h = _expert_matmul(self, up, e, hidden_states[token_idx])
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        h = _expert_matmul(self, "down_proj", e, h)
        if self.has_post_expert_norm:
            h = self.post_expert_norm(h)
        h = h * top_k_weights[token_idx, top_k_pos, None]
        # index_put_(accumulate) rather than upstream's index_add_, whose backward keeps its
        # source (S_e x h per expert, torch 2.13); the weighted output is then saved by no one,
        # as in transformers' grouped_mm path (a gather and a sum)
        final.index_put_((token_idx,), h.to(final.dtype), accumulate=True)
    return final


def packed_bytes(model: nn.Module) -> int:
    """Bytes the quantized expert weights take (packed data and constants)."""
    total = 0
    for _, m in fused_experts(model):
        for pname in EXPERT_WEIGHTS:
            for suffix in ("_4bit", "_absmax", "_absmax2", "_offset"):
                t = getattr(m, pname + suffix, None)
                if t is not None:
                    total += t.numel() * t.element_size()
    return total
