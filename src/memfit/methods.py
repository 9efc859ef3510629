"""What each training method runs in one micro step: the shape the estimator, the probes,
selection, the workflow and the trainer share.

One row of a method's data is what `micro_batch` counts: an SFT example, a preference pair
(DPO, reward model, ORPO, SimPO: chosen and rejected, two sequences) or a KTO row (one
completion with a desirable/undesirable label, plus its mismatched KL completion).

| method | sequences with gradient | policy forwards without gradient | reference | head |
|---|---|---|---|---|
| sft | 1 | 0 | none | vocabulary logits |
| dpo | 2 (chosen, rejected) | 0 | model, adapter or precomputed (2 sequences) | vocabulary logits |
| rm | 2 | 0 | none | one score per token (`AutoModelForSequenceClassification`, num_labels=1) |
| orpo, simpo | 2 | 0 | none | vocabulary logits |
| kto | 1 (the row) | 1 (the KL batch) | model, adapter or precomputed (2 sequences) | vocabulary logits |

Sources: TRL 1.16's trainers (`RewardTrainer`: one forward of chosen+rejected through a
sequence-classification model; `CPOTrainer` with `loss_type="simpo"` and `ORPOTrainer`: the
concatenated pair, no reference; `KTOTrainer`: the policy's KL log-probs under `torch.no_grad()`,
the reference on the rows and the KL batch) and memfit.train.preference, which follows them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args


@dataclass(frozen=True)
class MethodShape:
    name: str
    grad_sequences: int  # sequences per row whose activations are kept for the backward
    nograd_sequences: int  # sequences per row the policy runs without gradient (KTO's KL batch)
    reference: bool  # a reference model's log-probs (candidate.ref: model | adapter | precomputed)
    head: Literal["lm", "score"]  # lm: vocabulary logits; score: one output per token (reward model)
    data: Literal["sft", "pairs", "unpaired"]  # what a prepared row holds (memfit.data)
    # rows a micro batch needs: KTO's KL batch pairs each row with another row's completion (TRL's
    # KTOTrainer refuses 1; memfit.train.run_config.preference_problems too)
    min_micro_batch: int = 1

    @property
    def sequences(self) -> int:
        """Sequences per row the policy runs forward (with or without gradient)."""
        return self.grad_sequences + self.nograd_sequences

    @property
    def reference_sequences(self) -> int:
        """Sequences per row the reference runs forward (0 without a reference)."""
        return self.sequences if self.reference else 0


SHAPES: dict[str, MethodShape] = {
    s.name: s
    for s in (
        MethodShape("sft", 1, 0, False, "lm", "sft"),
        MethodShape("dpo", 2, 0, True, "lm", "pairs"),
        MethodShape("rm", 2, 0, False, "score", "pairs"),
        MethodShape("orpo", 2, 0, False, "lm", "pairs"),
        MethodShape("simpo", 2, 0, False, "lm", "pairs"),
        MethodShape("kto", 1, 1, True, "lm", "unpaired", min_micro_batch=2),
    )
}
METHODS: tuple[str, ...] = tuple(SHAPES)
REFERENCE_METHODS: tuple[str, ...] = tuple(m for m, s in SHAPES.items() if s.reference)
# the methods whose micro batch can run as one row of its sequences (`padding_free`,
# memfit.train.steps): every sequence scored on its own. Not KTO: its KL batch pairs each prompt with
# another row's completion, which the one-row batch does not build yet.
PADDING_FREE_METHODS: tuple[str, ...] = tuple(m for m, s in SHAPES.items() if s.data in ("sft", "pairs"))


def shape(method: str) -> MethodShape:
    """The method's shape; a ValueError naming the methods memfit trains for anything else."""
    try:
        return SHAPES[method]
    except KeyError:
        raise ValueError(f"unknown method {method!r}: memfit trains {', '.join(METHODS)}") from None


def speed_problems(method: str, padding_free: bool, sequence_parallel: int) -> list[str]:
    """What is wrong with the padding_free lever (docs/speed.md): the methods of PADDING_FREE_METHODS
    only, and not with sequence parallelism. The one home of the rule: the run config
    (memfit.train.run_config), the workflow's search space (memfit.workflow.config, search_checks)
    and `memfit estimate` ask it."""
    out = []
    if padding_free and method not in PADDING_FREE_METHODS:
        out.append(
            f"padding_free: applies to {', '.join(PADDING_FREE_METHODS)} only ({method}'s KL batch keeps "
            "padded rows); set it to false"
        )
    if padding_free and sequence_parallel > 1:
        out.append(
            f"padding_free: cannot be combined with sequence_parallel {sequence_parallel} (a shard of one "
            "concatenated row is not implemented); set padding_free: false or sequence_parallel: 1"
        )
    return out


# the kernels lever's values, spelled here only: Candidate.kernels' type (memfit.space), its check
# (Candidate.problems), kernels_problems and `memfit estimate --kernels` read them from here
Kernels = Literal["none", "liger"]
KERNELS: tuple[str, ...] = get_args(Kernels)
# the methods whose loss runs through memfit.train.liger.LigerHead (Liger's fused linear
# cross-entropy for SFT's NLL and DPO's log-probabilities)
LIGER_METHODS = ("sft", "dpo")


def kernels_problems(method: str, kernels: str) -> list[str]:
    """What is wrong with the kernels lever (docs/speed.md): none or liger, liger for LIGER_METHODS
    only. The one home of the rule, as `speed_problems` is padding_free's: the run config
    (memfit.train.run_config), the workflow's search space (memfit.workflow.config, search_checks)
    and `memfit estimate` ask it. Whether a machine can run it (package, GPU, model type) is
    memfit.train.liger.problem."""
    if kernels not in KERNELS:
        return [f"kernels: {kernels!r} is not allowed (allowed: {', '.join(map(repr, KERNELS))})"]
    if kernels == "liger" and method not in LIGER_METHODS:
        return [f"kernels: liger applies to {' and '.join(LIGER_METHODS)} only, not {method}; set kernels: none"]
    return []
