"""Activation offload to the host (Candidate.activation_offload, DeepSpeed ALST, arXiv 2506.13996
sec. 3.4): what leaves the device, what the host holds. The transfer time is costs.py's."""

from __future__ import annotations

from memfit.estimate.memory.activation_memory import Activations
from memfit.estimate.memory.method_terms import grad_seqs
from memfit.estimate.memory.states import pinned_rounding
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.settings import dtype_bytes
from memfit.space import Candidate


def checkpoint_input_bytes(arch: ModelArch, cand: Candidate, method: str) -> int:
    """One checkpointed decoder layer's input, the hidden states (d x tokens x hidden)."""
    tokens = grad_seqs(cand, method) * cand.seq_len
    return dtype_bytes(cand.precision) * tokens * arch.hidden_size


# DeepSpeed's CheckpointHiddenStatesOffload keeps the newest checkpointed input on the device
# (keep_last_count=1) and the device copies of the two before it until their copies to the host
# finish (max_fwd_stash_count=2): runtime/activation_checkpointing/offload_activations.py defaults
OFFLOAD_RESIDENT_INPUTS = 1 + 2


def offload_checkpoints(acts: Activations, arch: ModelArch, cand: Candidate, method: str) -> int:
    """Move the checkpointed layer inputs to the host (Candidate.activation_offload, on a GPU):
    all but `OFFLOAD_RESIDENT_INPUTS` leave the device, every one but the newest is copied into a
    pinned host buffer until its layer's backward copies it back, one buffer per input, each
    rounded like any pinned allocation (DeepSpeed pools them across steps,
    max_cpu_buffer_pool_count=64, so they stay). Lowers `acts` in place; returns the host bytes per
    rank."""
    if not (cand.activation_offload and cand.grad_ckpt):
        return 0
    per_input = checkpoint_input_bytes(arch, cand, method)
    moved = max(0, arch.num_layers - OFFLOAD_RESIDENT_INPUTS) * per_input
    acts.saved -= moved
    acts.forward -= moved
    return max(0, arch.num_layers - 1) * (per_input + pinned_rounding(per_input))
