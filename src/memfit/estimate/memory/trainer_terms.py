"""What a trainer adds to the saved activations of a micro step, beyond autograd's own: QLoRA's
dequantized weights (`qlora_dequant`), ZeRO-3's patched linear keeping its inputs
(`zero3_linear_inputs`), and the logits the loss holds (`apply_trainer_terms` adds them all to
an `Activations`, formula or traced)."""

from __future__ import annotations

import dataclasses

from memfit.estimate.memory.activation_memory import Activations, _layer_saved
from memfit.estimate.memory.held_logits import held_logits
from memfit.estimate.memory.method_terms import grad_seqs
from memfit.estimate.memory.micro_step import linear_names, micro_step
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.models.params import param_layout
from memfit.estimate.settings import Settings, dtype_bytes
from memfit.space import Candidate


def _largest_per_block(arch: ModelArch, bytes_of) -> tuple[int, int]:
    """(MLP, attention): the largest `bytes_of(in, out)` over each block's decoder linears."""
    names = linear_names(arch)
    attention = set(names["qkv"]) | {names["o"]}
    shapes = param_layout(arch).linear_shapes
    mlp = max((bytes_of(i, o) for n, i, o in shapes if n not in attention), default=0)
    attn = max((bytes_of(i, o) for n, i, o in shapes if n in attention), default=0)
    return mlp, attn


def qlora_dequant(arch: ModelArch, cand: Candidate) -> tuple[int, int]:
    """(MLP, attention) bytes of one dequantized weight: bitsandbytes' 4-bit matmul
    (bitsandbytes/autograd/_functions.py `MatMul4Bit.forward`:
    `torch.nn.functional.linear(A, F.dequantize_4bit(B, quant_state).to(A.dtype).t(), bias)`, and
    its backward's `torch.matmul(grad_output, F.dequantize_4bit(B, ctx.state).to(grad_output.dtype).t())`)
    materialises the whole weight in the compute dtype next to the matmul's input and output,
    in the forward, the recompute and the backward of every quantized linear. The largest of
    each block counts (0 unless finetune=qlora)."""
    if cand.finetune != "qlora":
        return 0, 0
    d = dtype_bytes(cand.precision)
    return _largest_per_block(arch, lambda i, o: d * i * o)


def qlora_backward_extra(arch: ModelArch, cand: Candidate, method: str) -> tuple[int, int]:
    """(MLP, attention) bytes a QLoRA layer's backward holds beyond the same layer under LoRA.

    A quantized linear's backward dequantizes its weight W for grad_input = grad_output @ W
    (bitsandbytes autograd/_functions.py `MatMul4Bit.backward`, on the CPU and CUDA alike) and
    frees it when the matmul returns; the adapter's branch then makes its own input gradient and
    the two are summed (peft tuners/lora/bnb.py `Linear4bit.forward`: base output + B(A(x))).
    A LoRA layer's backward peaks at that sum, holding 3 t*in*d bytes (base and adapter input
    gradients and their sum); the QLoRA layer holds W's d*in*out bytes next to one t*in*d at
    the base matmul. So the layer's backward rises by max(0, d*in*out - 2 t*in*d), t the tokens
    of the micro step (chosen and rejected for DPO): W when sequences are short, nothing when
    t > out/2 (measured on the CPU: benchmarks/bench_qlora_memory.py)."""
    if cand.finetune != "qlora":
        return 0, 0
    d = dtype_bytes(cand.precision)
    t = grad_seqs(cand, method) * cand.seq_len
    return _largest_per_block(arch, lambda i, o: max(0, d * i * o - 2 * t * i * d))


def zero3_linear_inputs(arch: ModelArch, cand: Candidate, method: str, settings: Settings) -> tuple[int, int]:
    """(bytes per decoder layer, bytes of the final norm) that frozen linears save under
    DeepSpeed ZeRO-3 beyond what PyTorch's own linear saves.

    `deepspeed.zero.Init` (transformers' `from_pretrained` under ZeRO-3, memfit's trainer
    included) replaces `torch.nn.functional.linear` with `zero3_linear_wrap` (DeepSpeed
    runtime/zero/partition_parameters.py `_enable_mem_efficient_linear`, on by default:
    zero_optimization.memory_efficient_linear; "This will persist unless manually reset"), whose
    `LinearFunctionForZeroStage3.forward` (runtime/zero/linear.py) calls
    `ctx.save_for_backward(input, weight, bias)` whether or not the weight trains. With LoRA the
    frozen base linears then keep their inputs: the second norm's output and the MLP product
    when no adapted linear already keeps them (targets other than all-linear), the final norm's
    output (lm_head's input) always. bitsandbytes' 4-bit linears (QLoRA) do not call F.linear;
    full fine-tuning saves every input anyway."""
    if cand.zero != 3 or cand.finetune != "lora" or settings.zero3_impl != "deepspeed":
        return 0, 0
    plain = micro_step(arch, cand, method, settings)
    wrapped = dataclasses.replace(plain, linear_inputs_saved=True)
    moe = bool(arch.moe_layers())
    layer = _layer_saved(cand, settings, wrapped, moe) - _layer_saved(cand, settings, plain, moe)
    final = wrapped.rmsnorm(True) - plain.rmsnorm(False)
    return layer, final


def apply_trainer_terms(
    acts: Activations, arch: ModelArch, cand: Candidate, method: str, settings: Settings
) -> Activations:
    """Add the terms that depend on the training stack rather than on the model's saved tensors
    (analytic or traced alike): another trainer's held logits (`held_logits`), the inputs
    ZeRO-3's linear keeps (`zero3_linear_inputs`) and QLoRA's dequantized weight
    (`qlora_dequant`, in the forward and inside a layer's backward)."""
    acts.loss_forward_extra, acts.held_logits = held_logits(arch, cand, method, settings)
    layer, final = zero3_linear_inputs(arch, cand, method, settings)
    if layer or final:
        L = arch.num_layers
        acts.per_layer += layer
        acts.final += final
        if cand.grad_ckpt:  # the recomputed layer keeps them through its backward
            acts.saved += final
            acts.mlp_bwd += layer
            acts.attn_bwd += layer
            acts.layer_bwd += layer
        else:
            acts.saved += L * layer + final
            acts.kept_per_layer += layer
            acts.forward += (L - 1) * layer
    mlp, attn = qlora_dequant(arch, cand)
    if mlp or attn:
        acts.dequant = max(mlp, attn)
        mlp, attn = qlora_backward_extra(arch, cand, method)
        # the increase of the larger of the two (a traced layer_bwd also folds in the
        # recomputation, so it is raised by the increase rather than recomputed)
        before = max(acts.mlp_bwd, acts.attn_bwd)
        acts.mlp_bwd += mlp
        acts.attn_bwd += attn
        acts.layer_bwd += max(acts.mlp_bwd, acts.attn_bwd) - before
        acts.forward += acts.dequant
    return acts
