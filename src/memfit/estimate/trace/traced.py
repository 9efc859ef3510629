"""Activations from a traced run of the model's own code on fake tensors (memfit.estimate.trace.trace): when the
trace applies (`traced_fallback_reason`: otherwise the formulas of activation_memory answer),
the traced figures scaled to the candidate (`traced_activations`), and tracing a whole search
space's architectures ahead, in parallel (`prefetch_traces`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from memfit.estimate.memory.activation_memory import Activations
from memfit.estimate.memory.method_terms import forward_seqs, grad_seqs, lm_head, nograd_seqs
from memfit.estimate.memory.padding_mask import padding_mask_extra, padding_mask_once
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.models.catalog import GPU
from memfit.estimate.models.generic import layer_groups
from memfit.estimate.models.params import lora_adapts_experts, peft_targets
from memfit.estimate.models.validity import hardware_problems, model_problems
from memfit.estimate.settings import EstimateError, Settings, dtype_bytes
from memfit.space import Candidate


def traced_fallback_reason(arch: ModelArch, cand: Candidate, settings: Settings) -> str:
    """Why a traced run cannot stand for this configuration ("" when it can); the estimate then
    uses the formulas and says so. Mixture-of-experts models trace (transformers' default
    grouped_mm experts run on fake tensors: every token goes to k experts, so the shapes do not
    depend on the routing; tests/test_estimate_moe.py compares them), except:
    - dense and MoE layers mixed (Qwen-MoE mlp_only_layers, DeepSeek's first dense layers): the
      trace's per-layer terms come from its first two layers;
    - LoRA with peft's expert adapters (`states.lora_adapts_experts`): the traced run misses the
      parametrized expert weights each layer keeps (seen in a real CPU measurement)."""
    if cand.padding_free and cand.attn == "eager" and not arch.generic:
        # the trace runs one sequence of seq_len and scales it to the batch: b x s^2 scores, where the
        # padding-free row keeps T x T (memory.micro_step)
        return "padding_free under eager attention: the one row's scores (all its tokens squared) are the formulas'"
    if not arch.is_moe or arch.generic:  # generic cards have no formulas to fall back on
        return ""
    if arch.dense_layers:
        return (
            f"{arch.name} mixes dense layers {list(arch.dense_layers)} with MoE layers; the trace "
            f"measures two identical layers"
        )
    if cand.finetune != "full" and lora_adapts_experts(arch, settings, cand.finetune):
        return (
            "LoRA on the routed experts (peft all-linear on an MoE model): the traced run misses "
            "the parametrized expert weights each layer keeps"
        )
    return ""


def trace_attn(arch: ModelArch, attn: str) -> str:
    """The attention the CPU trace runs for `attn`: FlashAttention-2 as SDPA (trace.traced_attn),
    or as eager where the class has no SDPA (gpt-oss: an upper bound, its scores materialised)."""
    from memfit.estimate.trace import trace

    traced = trace.traced_attn(attn)
    if traced == "sdpa" and arch.generic and "sdpa" not in arch.inventory().attn:
        return "eager"
    return traced


# Set by memfit.estimate.fit while it searches a length: (layer card, trace_request with seq_len 0,
# cache dir) -> a function of seq_len giving the LayerTrace its fitted form predicts from traces
# at a few lengths, so a search step does not trace its own length.
EXTRAPOLATED: dict[tuple, Callable[[int], Any]] = {}


def trace_request(arch: ModelArch, cand: Candidate, settings: Settings, seq_len: int | None = None):
    """The trace.TraceRequest this candidate's estimate reads (at `seq_len`, default the candidate's)."""
    from memfit.estimate.trace import trace

    return trace.TraceRequest(
        cand.seq_len if seq_len is None else seq_len,
        trace_attn(arch, cand.attn),
        cand.precision,
        cand.grad_ckpt,
        trace.traced_finetune(cand.finetune),
        cand.lora_rank,
        peft_targets(arch, cand, settings),  # QLoRA of fused experts: the experts left frozen
    )


def traced_run(arch: ModelArch, cand: Candidate, settings: Settings):
    """The cached trace of this candidate's shape (trace.LayerTrace; trace.MixedTrace for a
    model whose layers differ, each kind traced on its own: generic.layer_groups); while
    memfit.estimate.fit searches, the fitted form it registered in EXTRAPOLATED."""
    from memfit.estimate.trace import trace

    req = trace_request(arch, cand, settings)
    shape = dataclasses.replace(req, seq_len=0)
    try:
        runs = []
        for n, card, _ in layer_groups(arch):
            form = EXTRAPOLATED.get((card, shape, str(settings.trace_cache)))
            if form is not None:
                runs.append((n, form(cand.seq_len)))
                continue
            fields = dataclasses.astuple(req)
            runs.append((n, trace.layer_trace(card, *fields, cache_dir=settings.trace_cache)))
    except trace.TraceError as exc:
        raise EstimateError(str(exc)) from None
    return runs[0][1] if len(runs) == 1 else trace.MixedTrace(tuple(runs))


def traced_step_flops(arch: ModelArch, cand: Candidate, method: str, settings: Settings, recompute: bool) -> float:
    """FLOPs of one optimizer step on one rank from the traced step (trace_flops: torch's
    FlopCounterMode formulas, memfit's own for every attention kernel, on the model's own code): per sequence, 1 and 2 layers, scaled to the
    candidate as the memory is; the forwards without gradient (a reference's, KTO's KL batch) add
    their sequences' forward; `recompute=False` takes the checkpointed layers' recomputed forward
    out (MFU's model FLOPs). A reward model is traced as its causal LM: its vocabulary head's
    matmul (2 h V per token, forward and backward) is taken out, its h x 1 score's left out."""
    traced = traced_run(arch, cand, settings)
    seqs = grad_seqs(cand, method)
    L = arch.num_layers
    flops = traced.at("flops", L, seqs)
    if cand.grad_ckpt and not recompute:
        flops -= L * traced.per_layer("fwd_flops", seqs)
    if nograd_seqs(cand, method):
        flops += traced.at("fwd_flops", L, nograd_seqs(cand, method))
    if not lm_head(method):
        head = 2 * arch.hidden_size * arch.vocab_size * seqs * cand.seq_len
        flops -= head * (3 if cand.finetune == "full" else 2)
    return float(cand.grad_accum * flops)


def traced_activations(
    arch: ModelArch, cand: Candidate, method: str, settings: Settings, analytic: Activations
) -> Activations:
    """The activation terms from a traced run (memfit.estimate.trace.trace): the model's own code on fake
    tensors, 1 and 2 layers, per sequence, measured with torch's MemTracker and cached.

    Every per-layer quantity is the 2-layer minus the 1-layer run, the rest the 1-layer run
    minus one layer (trace.LayerTrace.at); everything is multiplied by the sequences of the
    micro step (DPO: chosen + rejected). The fields mean what `activations` documents, with
    recomputation folded into `layer_bwd` (the top layer's backward peak over what is kept when
    it starts). Kept from the analytic terms: the DPO reference forward (not traced: MemTracker
    follows one forward of a root module) and the eager probabilities' share for the note.
    """
    seqs = grad_seqs(cand, method)
    L = arch.num_layers
    traced = traced_run(arch, cand, settings)
    # the int64 input ids, attention mask and labels the trainer's collate makes (created
    # outside the trace's tracker) and the rotary cos/sin table shared by the batch (not in
    # the per-sequence measures): counted as `activations` counts them
    ids = 3 * 8 * forward_seqs(cand, method) * cand.seq_len + 2 * 4 * cand.seq_len * arch.head_dim
    acts = Activations()
    acts.saved = traced.saved(L, seqs) + ids
    acts.kept_per_layer = traced.per_layer("saved", seqs)
    acts.per_layer = traced.per_layer("saved", seqs) if not cand.grad_ckpt else analytic.per_layer
    # what the loss keeps once the model output is dropped: the fp32 log-softmax and friends
    pre_loss_without_logits = traced.seq("pre_loss", 1) - traced.seq("logits_bytes", 1)
    acts.logits_saved = seqs * (traced.seq("saved", 1) - pre_loss_without_logits)
    acts.logits_bwd_extra = traced.at("loss_bwd_peak", L, seqs) + ids - acts.saved
    kept = traced.at("top_pre_bw", L, seqs) + ids  # alive when the top layer's backward starts
    acts.final = acts.saved - acts.logits_saved - kept
    acts.recompute = 0  # folded into layer_bwd, which is measured with the recomputation in it
    acts.layer_bwd = traced.at("top_peak_bw", L, seqs) + ids - kept
    acts.mlp_bwd = traced.at("top_mlp_peak_bw", L, seqs) + ids - kept
    acts.attn_bwd = traced.at("top_attn_peak_bw", L, seqs) + ids - kept
    acts.forward = traced.at("fwd_peak", L, seqs) + ids
    if arch.generic:
        acts.bottom_bwd = traced.at("bottom_peak_bw", L, seqs) + ids
    if arch.generic and cand.finetune != "full" and lora_adapts_experts(arch, settings, cand.finetune):
        # peft's ParamWrapper builds W + BA for the experts (and router) it parametrizes in every
        # MoE layer's forward and the grouped matmul keeps it for the backward; the traced run
        # does not see it (it is made outside the module MemTracker follows): counted here as
        # activation_memory.moe_mlp_saved counts it for the hand-written cards
        from memfit.estimate.models.layer_counts import lora_parametrized_numel

        kept = dtype_bytes(cand.precision) * lora_parametrized_numel(arch.hf_config)
        acts.saved += len(arch.moe_layers()) * kept
        acts.per_layer += kept
        acts.kept_per_layer += kept
        acts.forward += len(arch.moe_layers()) * kept
    # the trace runs an all-ones mask, which transformers drops: a padded forward's (2+ rows;
    # one row is never padded, padding_mask._padded) repeated K/V and per-layer mask, and
    # its bool mask once, are added as the formulas count them (_padding_mask_extra, _once)
    padded = padding_mask_extra(arch, cand, method, settings)
    once = padding_mask_once(arch, cand, method, settings)
    acts.forward += once
    if cand.grad_ckpt:  # every checkpointed layer's input, kept to the backward
        acts.saved += once
    if padded:
        acts.per_layer += padded
        if cand.grad_ckpt:  # the recomputed layer saves them again inside its backward
            acts.layer_bwd += padded
            acts.mlp_bwd += padded
            acts.attn_bwd += padded
        else:
            acts.saved += L * padded
            acts.kept_per_layer += padded
            acts.forward += L * padded
    acts.attention_scores = analytic.attention_scores
    acts.ref_forward = analytic.ref_forward
    if cand.kernels == "liger":  # the trace runs transformers' layer: Liger's savings priced on it
        from memfit.estimate.memory import liger_terms
        from memfit.estimate.memory.micro_step import micro_step

        liger_terms.adjust(acts, micro_step(arch, cand, method, settings), cand, len(arch.moe_layers()))
    _head_from_formulas(acts, arch, cand, method, analytic)
    return acts


def _head_from_formulas(
    acts: Activations, arch: ModelArch, cand: Candidate, method: str, analytic: Activations
) -> None:
    """Where the traced run's head and loss are not the ones training runs, their terms in `acts`
    swapped for the formulas' (`analytic`): a reward model's score head, memfit's chunked loss."""
    if not lm_head(method):
        # a reward model is traced as its causal LM (the trace shares the LM's cached runs; the
        # layers are the same modules): the head's terms are swapped for the score's, as the
        # formulas count them (activation_memory.activations). A hand-written card's forward
        # peak is the formulas'; a generic card's keeps the traced one (logits included: an
        # upper bound of the forward phase).
        acts.saved += analytic.logits_saved - acts.logits_saved
        acts.saved += analytic.final - acts.final  # the score trains: it saves the final norm's output
        acts.logits_saved, acts.logits_bwd_extra, acts.final = (
            analytic.logits_saved,
            analytic.logits_bwd_extra,
            analytic.final,
        )
        if not arch.generic:
            acts.forward = min(acts.forward, analytic.forward)
    elif cand.loss_impl == "chunked" or cand.kernels == "liger":
        # the trace runs the model's own head and HF's loss; the chunked loss and Liger's are memfit's own code
        # (memfit.train.vocab_loss) whose tensors `chunked_loss_terms` counts: swap the logit terms
        acts.saved += analytic.logits_saved - acts.logits_saved
        acts.logits_saved, acts.logits_bwd_extra = analytic.logits_saved, analytic.logits_bwd_extra
        if not arch.generic:  # no formulas to take the forward's logits out with: kept whole
            acts.forward = min(acts.forward, analytic.forward)


def prefetch_traces(arch: ModelArch, gpu: GPU, candidates, settings: Settings) -> None:
    """Trace every shape the candidates need that is not cached yet, every kind of layer in one
    batch on one pool of child processes (memfit.estimate.trace.trace.layer_traces_of_kinds), so a
    new architecture's space pays one worker start per worker."""
    from memfit.estimate.trace import trace

    requests = {}
    for c in candidates:
        if hardware_problems(gpu, c) or model_problems(arch, c) or traced_fallback_reason(arch, c, settings):
            continue
        fused = not model_problems(arch, dataclasses.replace(c, attn="sdpa"))
        for attn in {c.attn, "sdpa"} if (c.attn == "eager" and fused) else {c.attn}:
            r = trace.TraceRequest(
                c.seq_len,
                trace_attn(arch, attn),
                c.precision,
                c.grad_ckpt,
                trace.traced_finetune(c.finetune),
                c.lora_rank,
                settings.lora_targets,
            )
            requests[r] = None
    try:  # every kind of layer at once, on one pool of workers
        batches = [(card, list(requests)) for _, card, _ in layer_groups(arch)]
        trace.layer_traces_of_kinds(batches, cache_dir=settings.trace_cache)
    except trace.TraceError as exc:
        raise EstimateError(str(exc)) from None
