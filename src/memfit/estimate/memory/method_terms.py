"""What a training method runs per micro step, in the estimator's terms (memfit.methods' shape
of the method times the candidate): the sequences whose activations are kept for the backward,
the forwards without gradient (KTO's KL batch, a reference model's), and whether the head is the
vocabulary's (logits, log-softmax) or a reward model's one-output score."""

from __future__ import annotations

import dataclasses

from memfit.estimate.models.arch import ModelArch
from memfit.methods import METHODS, shape
from memfit.space import Candidate

__all__ = ["METHODS", "shape", "grad_seqs", "forward_seqs", "nograd_forward_seqs", "reference_runs", "reference_model"]

# the methods the trainer runs under Ulysses sequence parallelism (memfit.train.preference.step
# refuses a sequence shard for rm, orpo, simpo and kto)
SEQUENCE_PARALLEL_METHODS = ("sft", "dpo")


def grad_seqs(cand: Candidate, method: str) -> int:
    """Sequences of the micro step whose activations autograd keeps (DPO: chosen + rejected)."""
    return cand.micro_batch * shape(method).grad_sequences


def forward_seqs(cand: Candidate, method: str) -> int:
    """Sequences the policy runs forward, with or without gradient (KTO: the rows and the KL batch)."""
    return cand.micro_batch * shape(method).sequences


def reference_runs(cand: Candidate, method: str) -> bool:
    """Whether a reference model runs forward in the step (ref model or adapter; not precomputed)."""
    return shape(method).reference and cand.ref in ("model", "adapter")


def reference_model(cand: Candidate, method: str) -> bool:
    """Whether the step holds a second, frozen copy of the weights (ref: model)."""
    return shape(method).reference and cand.ref == "model"


def reference_seqs(cand: Candidate, method: str) -> int:
    """Sequences the reference runs forward in the step (0 without one or when precomputed)."""
    return cand.micro_batch * shape(method).reference_sequences if reference_runs(cand, method) else 0


def nograd_seqs(cand: Candidate, method: str) -> int:
    """Sequences the policy and the reference run without gradient (their forwards' FLOPs)."""
    return cand.micro_batch * shape(method).nograd_sequences + reference_seqs(cand, method)


def nograd_forward_seqs(cand: Candidate, method: str) -> int:
    """Sequences of the largest single forward without gradient (0: none): DPO's reference runs the
    concatenated chosen + rejected batch at once (memfit.train.steps); KTO's policy and reference
    run the rows and the KL batch one forward each (memfit.train.preference.kto.step)."""
    s = shape(method)
    ref = s.grad_sequences if reference_runs(cand, method) else 0
    return cand.micro_batch * max(ref, s.nograd_sequences)


def lm_head(method: str) -> bool:
    """Whether the method's model ends in the vocabulary head (False: a reward model's score)."""
    return shape(method).head == "lm"


def method_arch(arch: ModelArch, method: str) -> ModelArch:
    """The model the method trains: a reward model (`AutoModelForSequenceClassification`,
    num_labels=1) has a one-output score Linear(h, 1) instead of the vocabulary head, untied from
    the embedding (ModelArch.score_head). A generic card keeps its inventory, which counts the
    causal LM's head (an upper bound by V x h parameters)."""
    if lm_head(method) or arch.generic:
        return arch
    return dataclasses.replace(arch, tie_word_embeddings=False, score_head=True)


def nograd_forward_passes(cand: Candidate, method: str) -> int:
    """Forward passes without gradient in one micro step, each over the rows' size: DPO's
    reference runs chosen + rejected at once (1); KTO runs the policy on the KL batch (1) and the
    reference on the rows and on the KL batch (2 more, none with precomputed log-probs)."""
    s = shape(method)
    kl = 1 if s.nograd_sequences else 0
    return kl + ((1 + kl) if reference_runs(cand, method) else 0)
