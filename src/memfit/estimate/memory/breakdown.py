"""What the peak of a step consists of: the phase that holds it (memfit.estimate.memory.phases)
broken into the table's components (params, grads, optimizer, activations, logits, reference,
temporaries), each from the terms that phase holds (`peak_breakdown`); the DPO reference's share
(`_reference_share`: a frozen copy, none for a precomputed or adapter reference)."""

from __future__ import annotations

from memfit.estimate.memory.activation_memory import Activations
from memfit.estimate.memory.method_terms import reference_model
from memfit.estimate.memory.phases import StepPhases, optimizer_step_grads
from memfit.estimate.memory.states import ModelStates
from memfit.estimate.settings import dtype_bytes
from memfit.space import Candidate


def _reference_share(states: ModelStates, cand: Candidate, method: str, trainable: int, world: int) -> int:
    """The reference copy's part of `states.params` (DPO, KTO with ref=model: the same weights again)."""
    if not reference_model(cand, method):
        return 0
    if cand.finetune == "full":
        return states.params // 2
    # params = weights + adapters + reference weights; the reference weights = the weights
    adapters = (trainable * dtype_bytes(cand.precision)) // (world if cand.zero == 3 else 1)
    return (states.params - adapters) // 2


def _forward_backward_breakdown(
    phases: StepPhases,
    states: ModelStates,
    acts: Activations,
    cand: Candidate,
    breakdown: dict[str, int],
) -> None:
    where = phases.peak_phase
    grads = phases.grads
    breakdown["temporaries"] += phases.gathered
    if where == "forward":
        breakdown["grads"] += grads.held
        breakdown["activations"] = acts.forward
    elif where in ("loss_backward", "loss_forward"):
        breakdown["grads"] += grads.held
        breakdown["activations"] = acts.saved - acts.logits_saved
        breakdown["logits"] = acts.logits_saved + acts.logits_bwd_extra
        if where == "loss_forward":
            breakdown["logits"] += acts.loss_forward_extra
    elif where == "backward_end":
        breakdown["grads"] += states.grads_dynamic
        breakdown["temporaries"] += phases.backward_end - states.grads_dynamic
    else:  # the top or the bottom layer's backward
        present = grads.head if where == "top_layer_backward" else grads.below_bottom
        present = (grads.held if grads.held else present) + grads.tied_pending
        breakdown["grads"] += present
        breakdown["activations"] = phases.forward_backward[where] - present - acts.held_logits
    if where == "backward_end":
        breakdown["temporaries"] -= acts.held_logits
    breakdown["logits"] += acts.held_logits


def peak_breakdown(
    phases: StepPhases,
    states: ModelStates,
    acts: Activations,
    cand: Candidate,
    method: str,
    trainable: int,
    world: int,
) -> dict[str, int]:
    """The components of the peak phase's allocated bytes (they sum to it); "overheads" is 0
    here (fragmentation and the CUDA context are not allocated)."""
    breakdown = {
        "params": states.params,
        "grads": states.grads,
        "optimizer": states.optimizer,
        "activations": 0,
        "logits": 0,
        "reference": 0,
        "temporaries": states.buckets,
        "overheads": 0,
    }
    reference = _reference_share(states, cand, method, trainable, world)
    breakdown["params"] -= reference
    breakdown["reference"] = reference
    where = phases.peak_phase
    if where in phases.forward_backward:
        _forward_backward_breakdown(phases, states, acts, cand, breakdown)
    elif where == "optimizer_step":
        grads, temporaries = optimizer_step_grads(states, phases.optimizer_temporaries)
        breakdown["grads"] += grads
        breakdown["temporaries"] += temporaries
        breakdown["logits"] += acts.held_logits
    elif where == "resume":
        if cand.zero != 3:  # below ZeRO-3 the gradients and buckets appear at the first backward
            breakdown["grads"] = 0
            breakdown["temporaries"] = 0
        breakdown["optimizer"] += phases.resume_copies  # what the load holds beside the state
    else:  # reference_forward
        breakdown["temporaries"] += phases.gathered + acts.ref_forward + states.ref_gathered
        breakdown["activations"] = acts.saved - acts.logits_saved
        breakdown["logits"] = acts.logits_saved
    return breakdown
