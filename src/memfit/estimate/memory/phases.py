"""Which phase of training holds the device peak, and what is in memory then.

A step's phases: the forward, the loss backward, the top and the bottom layer's backward, the
end of the backward, the optimizer step, a resume (loading optimizer states), and for DPO the
reference forward. Each phase's allocated bytes are the model states present throughout
(`static`) plus what that phase adds; `peak_breakdown` splits the peak phase into components.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memfit.estimate.memory.activation_memory import Activations
from memfit.estimate.memory.states import ModelStates
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.models.params import lora_targets, param_layout
from memfit.estimate.settings import TRAINER_LOADERS, EstimateError, Settings, dtype_bytes
from memfit.space import Candidate

FORWARD_BACKWARD = (
    "forward",
    "loss_forward",  # only with another trainer's logits handling (Settings.logits_handling)
    "loss_backward",
    "top_layer_backward",
    "bottom_layer_backward",
    "backward_end",
)


@dataclass
class BackwardGradients:
    """Gradient bytes that appear during the backward, before the optimizer step."""

    head: int = 0  # lm_head's weight gradient (ZeRO-0/1, full)
    per_layer: int = 0  # one decoder layer's weight gradients (ZeRO-0/1)
    below_bottom: int = 0  # at the bottom layer's backward: head + every other layer's
    tied_pending: int = 0  # tied embeddings: the head's [V, h] gradient waiting for the embedding's
    held: int = 0  # gradients that outlive their micro step (ZeRO-0/1/2 with grad_accum)


@dataclass
class StepPhases:
    """Allocated bytes of each phase, and the terms `peak_breakdown` splits the peak into."""

    static: int  # params + grads + optimizer + buckets (+ the cuBLAS workspaces), present in every phase but resume
    gathered: int  # ZeRO-3 gathered module, present in the forward/backward phases
    forward_backward: dict[str, int]  # each forward/backward phase beyond static + gathered
    grads: BackwardGradients
    backward_end: int  # the backward's last gradients (embedding's), held gradients not included
    optimizer_step: int
    resume: int
    reference_forward: int  # DPO reference forward (0: none)
    allocated: dict[str, int] = field(default_factory=dict)  # every phase, total bytes
    optimizer_temporaries: int = 0  # the optimizer update's own temporaries (`_optimizer_temporaries`)
    resume_copies: int = 0  # loaded tensors live beside the state at resume (`_resume`)

    @property
    def peak_phase(self) -> str:
        return max(self.allocated, key=self.allocated.get)


def _in_layer_backward(arch: ModelArch, cand: Candidate, acts: Activations, layer_grad: int) -> int:
    """Transients at one layer's backward. Inside a layer's backward the weight gradients of that
    layer appear part by part: at the MLP's peak only down_proj's, at the attention's the MLP's
    and o_proj's."""
    if not (layer_grad and cand.finetune == "full"):
        return acts.layer_bwd + layer_grad
    d = dtype_bytes(cand.precision)
    shapes = param_layout(arch).linear_shapes
    mlp_linear = sum(i * o for n, i, o in shapes if n in ("down_proj", "dense_4h_to_h"))
    attention_linear = sum(i * o for n, i, o in shapes if n not in ("q_proj", "k_proj", "v_proj", "query_key_value"))
    return max(
        acts.mlp_bwd + d * mlp_linear,
        acts.attn_bwd + d * (attention_linear + arch.hidden_size),
    )


def _backward_gradients(arch: ModelArch, cand: Candidate, trainable: int) -> BackwardGradients:
    d = dtype_bytes(cand.precision)
    layout = param_layout(arch)
    full = cand.finetune == "full"
    grads = BackwardGradients()
    if cand.zero < 2:  # ZeRO-2/3 move gradients into their partitions as they arrive
        grads.head = d * layout.lm_head if full else 0
        grads.per_layer = d * (layout.per_layer if full else trainable // arch.num_layers)
    grads.below_bottom = grads.head + (arch.num_layers - 1) * grads.per_layer
    # Tied embeddings, full fine-tuning: the head's [V, h] weight gradient waits in autograd's
    # input buffer of the shared weight's AccumulateGrad until the embedding's backward adds its
    # share (torch/csrc/autograd/input_buffer.cpp accumulates; engine.cpp runs a node once all
    # its inputs arrived), i.e. through every layer's backward, at every ZeRO stage (DeepSpeed's
    # gradient hooks fire at accumulation). Seen by the traced run (memfit.estimate.trace.trace, real and fake
    # tensors alike: a TEMP [V, h] tensor at each layer's backward).
    grads.tied_pending = d * layout.embed if (full and arch.tie_word_embeddings) else 0
    return grads


def _forward_backward(
    arch: ModelArch,
    cand: Candidate,
    states: ModelStates,
    acts: Activations,
    grads: BackwardGradients,
) -> dict[str, int]:
    """Each forward/backward phase beyond the static states. The peak is at the loss backward
    (all activations + logit gradients) or inside the first or last layer's backward (gradients
    grow while activations shrink)."""
    d = dtype_bytes(cand.precision)
    # while the layers run backward, the logits and the final norm's tensors are gone
    layers_kept = acts.saved - acts.logits_saved - acts.final
    in_layer = _in_layer_backward(arch, cand, acts, grads.per_layer)
    top = layers_kept + acts.recompute + in_layer + grads.head + grads.tied_pending
    bottom_kept = layers_kept - (arch.num_layers - 1) * acts.kept_per_layer
    bottom = bottom_kept + acts.recompute + in_layer + grads.below_bottom + grads.tied_pending
    # a traced bottom layer that costs more than the top one's terms say (Gemma-4 with
    # checkpointing: the gradients of every layer's per-layer inputs meet there)
    bottom = max(bottom, acts.bottom_bwd + grads.below_bottom + grads.tied_pending)
    if cand.finetune == "full" and cand.zero < 2:
        # embedding_dense_backward's [V, h] gradient arrives last (twice when tied: accumulated)
        embedding = d * param_layout(arch).embed if arch.tie_word_embeddings else 0
        end = states.grads_dynamic + embedding
    else:
        end = 0
    out = {
        "forward": acts.forward,
        "loss_backward": acts.saved + acts.logits_bwd_extra,
        "top_layer_backward": top,
        "bottom_layer_backward": bottom,
        "backward_end": end,
    }
    if acts.loss_forward_extra:  # another trainer's loss forward holds more [t, V] tensors
        out["loss_forward"] = out["loss_backward"] + acts.loss_forward_extra
    # another trainer's logits, referenced from the loss through the backward (and, until the
    # next forward rebinds them, through that forward: held_logits.held_logits)
    return {k: v + acts.held_logits for k, v in out.items()}


def _hold_gradients(
    cand: Candidate, trainable: int, world: int, phases: dict[str, int], grads: BackwardGradients
) -> None:
    """Gradients that outlive the micro step they were produced in (DeepSpeed engines), added to
    the forward/backward phases.

    ZeRO-0, grad_accum > 1: runtime/engine.py `DeepSpeedEngine.step` calls `_take_model_step`
    (optimizer.step + zero_grad) only at `is_gradient_accumulation_boundary()`, so the plain
    torch optimizer's param.grad (d*T) stays allocated through the next micro steps' forward and
    backward, and autograd accumulates into it (no new full-size gradient per micro step).
    ZeRO-3 holds no full-size gradient beyond the module in flight (counted with the gathered
    parameters, `zero3.zero3_gathered_bytes`): what looked like held gradients on the 2-rank
    gloo probes is the gathered parameters DeepSpeed keeps for reuse, the same bytes for full
    fine-tuning, present for frozen weights too. ZeRO-1/2, grad_accum > 1: between the micro
    steps of an optimizer step DeepSpeed keeps the gradients of its partition's parameters to
    accumulate into (stage_1_and_2.py `independent_gradient_partition_epilogue`: `all_grad_tensors`
    holds each partition parameter's `grad` until `is_gradient_accumulation_boundary()`), so
    from the second micro step on the forward and backward run beside them: at ZeRO-1 every
    16-bit gradient (d*T, reduced only at the boundary), at ZeRO-2 the partition's (d*T/N; the
    parameters a partition boundary cuts are held whole, up to two tensors more, not counted).
    Measured on 2 CPU ranks (demo model, micro batch 4 of 64 tokens): grad_accum 2 and 4 held
    the same bytes beyond grad_accum 1, ZeRO-1 +11.2 MB in fp32 and +6.0 MB in bf16 (d*T: 11.9
    and 6.0), ZeRO-2 +6.5 and +3.3 MB (d*T/2: 6.0 and 3.0). With the optimizer offloaded
    DeepSpeed accumulates on the host (the epilogue's `cpu_offload` branch): nothing held.
    """
    d = dtype_bytes(cand.precision)
    on_device = cand.offload_optimizer == "none"
    if cand.zero == 2 and on_device and cand.grad_accum > 1:
        grads.held = d * trainable // world
        for k in ("forward", "loss_forward", "loss_backward", "top_layer_backward", "bottom_layer_backward"):
            if k in phases:
                phases[k] += grads.held
    if cand.grad_accum > 1 and (cand.zero == 0 or (cand.zero == 1 and on_device)):
        grads.held = d * trainable
        counted = {"top_layer_backward": grads.head, "bottom_layer_backward": grads.below_bottom}
        for k in (
            "forward",
            "loss_forward",
            "loss_backward",
            "top_layer_backward",
            "bottom_layer_backward",
        ):
            if k in phases:
                phases[k] += grads.held - counted.get(k, 0)


def _optimizer_resident_fraction(cand: Candidate, states: ModelStates) -> float:
    if cand.zero == 3:
        return states.optimizer_resident_fraction
    return 0.0 if cand.offload_optimizer == "cpu" else 1.0


def _optimizer_temporaries(
    arch: ModelArch,
    cand: Candidate,
    states: ModelStates,
    trainable: int,
    world: int,
    settings: Settings,
) -> int:
    """The optimizer step's temporaries: torch's single-tensor AdamW holds sqrt(v) and the
    denominator for the largest tensor, foreach AdamW a full copy of v (torch/optim/adamw.py
    `_multi_tensor_adamw`: torch._foreach_sqrt), DeepSpeed's FusedAdam nothing. memfit's
    trainer gets DeepSpeed's FusedAdam on every accelerator (the optimizer type "AdamW" without
    `torch_adam`: engine.py `_configure_basic_optimizer`); the CPU accelerator's build
    (op_builder/cpu/fused_adam.py, csrc/cpu/adam/fused_adam.cpp) updates in place like the CUDA
    one: measured on the CPU, an fp32 ZeRO-2 step peaks at exactly 24 bytes per parameter, the
    gradient copies and no temporary (1 rank, demo model)."""
    impl = settings.optimizer_impl or "fused"
    on_device = _optimizer_resident_fraction(cand, states)
    largest_trainable = (
        param_layout(arch).largest_module
        if cand.finetune == "full"
        else max(cand.lora_rank * max(i, o) for _, i, o in lora_targets(arch, settings))
    )
    temporaries = {"single": 2 * 4 * largest_trainable, "foreach": 4 * trainable, "fused": 0}[impl]
    if cand.zero >= 1:
        temporaries = 0 if impl == "fused" else int(temporaries * on_device / max(world, 1))
    return int(temporaries * (on_device if cand.zero == 0 else 1))


def optimizer_step_grads(states: ModelStates, temporaries: int) -> tuple[int, int]:
    """(gradient bytes, temporaries) at the optimizer step's peak: the optimizer wrapper's
    gradient copies beside the backward's gradients, or the gradients the update runs on plus
    its temporaries, whichever is larger (`ModelStates.step_grads`, `update_grads`)."""
    copies = states.grads_dynamic + states.step_grads
    update = states.grads_dynamic if states.update_grads is None else states.update_grads
    return (copies, 0) if copies >= update + temporaries else (update, temporaries)


def _resume(
    cand: Candidate, states: ModelStates, trainable: int, world: int, settings: Settings, host_device: bool
) -> tuple[int, int]:
    """Allocated bytes when a checkpoint has loaded, before the first step (DeepSpeed 0.19.8), and
    the part of them that is loaded copies beside the state (the `resume` breakdown's extra).

    ZeRO-1/2/3 create Adam's m and v lazily, at the first step (runtime/zero/stage_1_and_2.py and
    stage3.py `initialize_optimizer_states`: "other optimizers ... do lazy initialization of the
    state at the first call to step"), and so does the Adam a 32-bit ZeRO-0 engine steps
    directly: a resumed process has no state when `torch.optim.Optimizer.load_state_dict` moves
    each loaded tensor to its device, and holds it once. ZeRO-0 in 16-bit is the exception:
    FP16_Optimizer's constructor runs a step on zero gradients (runtime/fp16/fused_optimizer.py
    `initialize_optimizer_states`), so m and v exist when DeepSpeed's load builds the loaded ones
    beside them (`trainer_loader` "deepspeed": +8 bytes per trainable parameter); memfit's loader
    copies into them (memfit.train.optimizer_load). ZeRO-1/2 allocate their gradient partition
    and reduce buckets at the first backward (stage_1_and_2.py `grads_in_partition =
    torch.empty(...)`, the IPG bucket buffers), ZeRO-3 its gradient partitions and buckets at
    initialisation (stage3.py `grad_partitions_flat_buffer`), so they count at ZeRO-3 only.

    DeepSpeed reads the checkpoint files whole into host RAM (`torch.load(map_location="cpu")`,
    overheads.host_memory prices it); on a GPU they never reach the device. Where the host is the
    device (memfit's CPU runs) DeepSpeed's loaded tensors are live beside the state: the module
    weights at ZeRO-0 (model and optimizer share one file; in 16-bit also FP16_Optimizer's fp32
    master, copied from its own entry) and the fp32 master partition at ZeRO-1/2/3. memfit's loader
    maps the files and copies a chunk at a time (memfit.train.stream_load): page cache, not
    allocations. Measured on 2 CPU ranks against this, per rank (`benchmarks/bench_resume_memory.py`):
    docs/resume.md."""
    if settings.trainer_loader not in TRAINER_LOADERS:
        raise EstimateError(f"trainer_loader must be one of {TRAINER_LOADERS}, got {settings.trainer_loader!r}")
    resume = states.params + states.optimizer
    fp16_optimizer = cand.zero == 0 and cand.precision != "fp32" and settings.zero0_engine == "deepspeed"
    deepspeed_load = settings.trainer_loader == "deepspeed"
    copies = 0
    if fp16_optimizer and deepspeed_load:
        copies += 8 * trainable  # DeepSpeed's load: the initialised m and v beside the loaded ones
    if host_device and deepspeed_load:
        if cand.zero == 0:
            # the module weights as saved: QLoRA checkpoints hold the adapter only
            # (memfit.train.adapter_state), full and LoRA ones the whole module
            module = dtype_bytes(cand.precision) * trainable if cand.finetune == "qlora" else states.params
            copies += module + (4 * trainable if fp16_optimizer else 0)
        elif cand.offload_optimizer == "none":
            copies += int(4 * trainable / world)
    if cand.zero == 3:
        resume += states.grads + states.buckets
    return resume + copies, copies


def step_phases(
    arch: ModelArch,
    cand: Candidate,
    states: ModelStates,
    acts: Activations,
    trainable: int,
    world: int,
    settings: Settings,
    host_device: bool = False,
    workspaces: int = 0,
) -> StepPhases:
    """Allocated bytes of every phase of a training step on one rank; `workspaces`: the cuBLAS
    workspaces the allocator holds from the first GEMMs on (calibration.allocator_workspaces), in
    every phase but the resume's, which comes before any GEMM."""
    static = states.params + states.grads + states.optimizer + states.buckets + workspaces
    grads = _backward_gradients(arch, cand, trainable)
    forward_backward = _forward_backward(arch, cand, states, acts, grads)
    backward_end = forward_backward["backward_end"]  # before held gradients are added
    _hold_gradients(cand, trainable, world, forward_backward, grads)
    optimizer_temporaries = _optimizer_temporaries(arch, cand, states, trainable, world, settings)
    resume, resume_copies = _resume(cand, states, trainable, world, settings, host_device)
    # DPO reference forward (no_grad) after the policy forward
    # ZeRO-3: the reference engine gathers its own parameters (states.ref_gathered)
    reference = (
        static + states.gathered + states.ref_gathered + acts.saved + acts.ref_forward if acts.ref_forward else 0
    )
    phases = StepPhases(
        static=static,
        gathered=states.gathered,
        forward_backward=forward_backward,
        grads=grads,
        backward_end=backward_end,
        optimizer_step=static + sum(optimizer_step_grads(states, optimizer_temporaries)) + acts.held_logits,
        resume=resume,
        reference_forward=reference,
        optimizer_temporaries=optimizer_temporaries,
        resume_copies=resume_copies,
    )
    allocated = {k: static + states.gathered + v for k, v in forward_backward.items()}
    allocated["optimizer_step"] = phases.optimizer_step
    allocated["resume"] = resume
    if reference:
        allocated["reference_forward"] = reference
    phases.allocated = {k: int(v) for k, v in allocated.items()}
    return phases
