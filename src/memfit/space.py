"""Which configurations to consider: the candidate dataclass and the search space.

A `Candidate` is one point of the search space: every knob that changes memory or
speed of a training step. It is shared by `estimate` (predict), `probe` (measure),
`select` (choose) and `train` (run), so each of them speaks about the same thing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from memfit.methods import KERNELS, Kernels
from memfit.methods import shape as method_shape

Method = Literal["sft", "dpo", "rm", "orpo", "simpo", "kto"]  # memfit.methods.SHAPES
Finetune = Literal["full", "lora", "qlora"]
Precision = Literal["bf16", "fp16", "fp32"]
Attn = Literal["flash", "sdpa", "eager"]
RefMode = Literal["precomputed", "model", "adapter"]
# the loss_impl lever's values, spelled here only (the check in Candidate.problems and
# `memfit estimate --loss-impl` read LOSS_IMPLS); the kernels lever's: memfit.methods.KERNELS
LossImpl = Literal["full", "chunked"]
LOSS_IMPLS: tuple[str, ...] = get_args(LossImpl)


@dataclass(frozen=True)
class Candidate:
    """One training configuration. Field names match `memfit estimate` flags."""

    zero: int = 2  # ZeRO stage 0|1|2|3
    offload_optimizer: Literal["none", "cpu"] = "none"  # optimizer states (+fp32 master) on the host
    offload_param: Literal["none", "cpu"] = "none"  # ZeRO-3 parameter offload to the host
    pin_memory: bool = False  # page-locked host buffers for offload (faster, costs host RAM)
    offload_ratio: float = 1.0  # ZeRO-3 offload_optimizer.ratio: fraction of optimizer states offloaded
    grad_ckpt: bool = False  # gradient (activation) checkpointing per decoder layer
    attn: Attn = "sdpa"  # attention implementation
    finetune: Finetune = "full"  # full fine-tuning, LoRA or QLoRA
    lora_rank: int = 16  # LoRA rank r (ignored for full)
    micro_batch: int = 1  # sequences per rank per forward (DPO: pairs, i.e. 2x sequences)
    seq_len: int = 2048  # tokens per sequence (padded worst case)
    grad_accum: int = 1  # micro steps per optimizer step
    precision: Precision = "bf16"  # compute/weights dtype; fp32 master weights kept by DeepSpeed
    # DPO reference: frozen copy, LoRA adapter disabled, or precomputed log-probs; None: the method has
    # no reference (SFT: WorkflowConfig.candidates sets it, so an SFT id names no DPO-only lever)
    ref: RefMode | None = "model"
    # full: the head's logits of every token, then an fp32 log-softmax (HF's loss) | chunked: the
    # head, log-softmax and target log-prob per token chunk, recomputed in backward (memfit.train.vocab_loss)
    loss_impl: LossImpl = "full"
    # Ulysses sequence parallelism (DeepSpeed ALST, deepspeed.runtime.sequence_parallel.ulysses_sp):
    # ranks that split each sequence, all-to-all around attention; data-parallel size = world / it
    sequence_parallel: int = 1
    # DeepSpeed ALST's TiledMLP (ulysses_sp.TiledMLP): every decoder layer's MLP runs a tile of the
    # tokens at a time, its intermediates recomputed per tile in the backward (memfit.train.long_context)
    tiled_mlp: bool = False
    # checkpointed layer inputs moved to host RAM between forward and backward (DeepSpeed's
    # CheckpointHiddenStatesOffload, activation_checkpointing/offload_activations.py); needs grad_ckpt
    activation_offload: bool = False
    # SFT and DPO micro batches as one row: the sequences concatenated, position ids restarting per
    # sequence, no padding (memfit.train.batches.padding_free_batch; docs/speed.md). Which methods take
    # it is the run config's rule (memfit.train.run_config.speed_problems)
    padding_free: bool = False
    # regional torch.compile of the decoder layers (memfit.train.compile, docs/speed.md): one
    # compiled layer reused by every layer; where it can run is memfit.train.compile.compile_problem
    compile: bool = False
    # Liger-Kernel's Triton kernels (memfit.train.liger, docs/speed.md): RMSNorm, RoPE, SwiGLU and the
    # loss through its fused linear cross-entropy (which replaces loss_impl: a liger candidate's is
    # "full", `_canonical`); which methods take it is memfit.methods.kernels_problems, where it can
    # run memfit.train.liger.problem
    kernels: Kernels = "none"

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("invalid candidate: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """Combinations DeepSpeed or peft cannot run, in the user's words."""
        out = []
        if self.zero not in (0, 1, 2, 3):
            out.append(f"zero must be 0, 1, 2 or 3, got {self.zero}")
        if self.offload_param != "none" and self.zero != 3:
            out.append("parameter offload (offload_param=cpu) needs ZeRO-3")
        if self.offload_optimizer != "none" and self.zero == 0:
            out.append("optimizer offload needs ZeRO stage 1, 2 or 3")
        if self.offload_ratio != 1.0 and not (self.zero == 3 and self.offload_optimizer == "cpu"):
            out.append("offload_ratio needs ZeRO-3 with offload_optimizer=cpu")
        if not 0.0 < self.offload_ratio <= 1.0:
            out.append(f"offload_ratio must be in (0, 1], got {self.offload_ratio}")
        if self.finetune != "full" and self.lora_rank < 1:
            out.append(f"lora_rank must be >= 1, got {self.lora_rank}")
        if self.ref == "adapter" and self.finetune == "full":
            out.append("ref=adapter needs finetune=lora or qlora (the reference is the adapter-free model)")
        if self.loss_impl not in LOSS_IMPLS:
            out.append(f"loss_impl must be {' or '.join(LOSS_IMPLS)}, got {self.loss_impl!r}")
        if self.kernels not in KERNELS:
            out.append(f"kernels must be {' or '.join(KERNELS)}, got {self.kernels!r}")
        if self.sequence_parallel > 1 and self.attn == "eager":
            # ulysses_sp.py register_with_transformers: eager needs a 4D mask Ulysses cannot shard
            out.append("sequence_parallel > 1 needs attn sdpa or flash (DeepSpeed's Ulysses refuses eager)")
        if self.activation_offload and not self.grad_ckpt:
            # DeepSpeed offloads the inputs of checkpointed layers, so without checkpointing nothing moves
            out.append("activation_offload needs grad_ckpt (it moves the checkpointed layer inputs to the host)")
        for name in ("micro_batch", "seq_len", "grad_accum", "sequence_parallel"):
            if getattr(self, name) < 1:
                out.append(f"{name} must be >= 1, got {getattr(self, name)}")
        return out

    def data_parallel(self, world: int) -> int:
        """Ranks that each draw their own rows: a sequence-parallel group shares one batch."""
        return world // self.sequence_parallel

    def global_batch(self, world: int) -> int:
        """Sequences (DPO: pairs) per optimizer step on `world` ranks."""
        return self.micro_batch * self.grad_accum * self.data_parallel(world)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Candidate:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown candidate keys {unknown}; allowed: {sorted(known)}")
        return cls(**dict(d))

    @property
    def id(self) -> str:
        """Short, stable, readable id used as the `{cand}` wildcard and in file names."""
        parts = [f"z{self.zero}"]
        if self.offload_optimizer != "none":
            parts.append("oo" + (f"{self.offload_ratio:g}" if self.offload_ratio != 1.0 else ""))
        if self.offload_param != "none":
            parts.append("op")
        if self.offload_optimizer != "none" or self.offload_param != "none":
            parts.append("pin" if self.pin_memory else "nopin")
        parts.append("gc" if self.grad_ckpt else "nogc")
        parts.append(self.attn)
        parts.append(self.finetune if self.finetune == "full" else f"{self.finetune}{self.lora_rank}")
        parts.append(f"mb{self.micro_batch}")
        parts.append(f"s{self.seq_len}")
        parts.append(self.precision)
        if self.ref is not None:  # DPO ids keep their ref-<mode>; SFT candidates have none
            parts.append(f"ref-{self.ref}")
        if self.loss_impl != "full":  # ids of full-loss candidates stay what they were
            parts.append(f"loss-{self.loss_impl}")
        if self.sequence_parallel != 1:
            parts.append(f"sp{self.sequence_parallel}")
        if self.tiled_mlp:
            parts.append("tmlp")
        if self.activation_offload:
            parts.append("aoff")
        if self.padding_free:
            parts.append("pf")
        if self.compile:
            parts.append("compiled")
        if self.kernels != "none":
            parts.append(self.kernels)
        return "-".join(parts)

    def digest(self) -> str:
        return hashlib.sha1(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:10]


def enumerate_space(axes: Mapping[str, Iterable[Any]], fixed: Mapping[str, Any] | None = None) -> Iterator[Candidate]:
    """Cartesian product of `axes` (field -> values) over `fixed` fields.

    Combinations that DeepSpeed cannot run (see `Candidate.problems`) are skipped,
    and duplicates that only differ in a field that does not apply (pin_memory
    without offload, lora_rank with full fine-tuning) are produced once.
    """
    fixed = dict(fixed or {})
    known = {f.name for f in dataclasses.fields(Candidate)}
    for key in list(axes) + list(fixed):
        if key not in known:
            raise ValueError(f"unknown search-space key {key!r}; allowed: {sorted(known)}")
    names = list(axes)
    seen: set[Candidate] = set()
    for values in itertools.product(*(list(axes[n]) for n in names)):
        d = {**fixed, **dict(zip(names, values, strict=True))}
        try:
            cand = Candidate(**d)
        except ValueError:
            continue
        cand = _canonical(cand)
        if cand not in seen:
            seen.add(cand)
            yield cand


def _canonical(c: Candidate) -> Candidate:
    """Reset fields that have no effect in this combination, so equal configs compare equal."""
    changes: dict[str, Any] = {}
    if c.offload_optimizer == "none" and c.offload_param == "none" and c.pin_memory:
        changes["pin_memory"] = False
    if c.finetune == "full" and c.lora_rank != Candidate.lora_rank:
        changes["lora_rank"] = Candidate.lora_rank
    if c.kernels == "liger" and c.loss_impl != "full":  # Liger's fused loss replaces memfit's chunked one
        changes["loss_impl"] = "full"
    return dataclasses.replace(c, **changes) if changes else c


# What a candidate's step time depends on, split the way memfit's calibration measures it
# (memfit.train.calibrate, priced by memfit.estimate.time.timing): the levers that make the
# DeepSpeed engine and the model it wraps (one engine per set), and the batch one micro step
# runs through that engine (any number per engine).
ENGINE_LEVERS = (
    "zero",
    "offload_optimizer",
    "offload_param",
    "pin_memory",
    "offload_ratio",
    "grad_ckpt",
    "attn",
    "finetune",
    "lora_rank",
    "precision",
)


def engine_key(c: Candidate) -> str:
    """The DeepSpeed engine a candidate trains with: its ZeRO/offload, checkpointing, attention,
    adapters and dtype (`c.id` without the batch)."""
    key = "|".join(f"{k}={getattr(c, k)}" for k in ENGINE_LEVERS)
    # the long-context levers change the engine (sequence parallelism its process groups and the
    # attention's all-to-all; the tiled MLP and the activation offload its layers); keys of
    # candidates without them stay what measured calibrations recorded
    extra = {
        "sequence_parallel": c.sequence_parallel,
        "tiled_mlp": c.tiled_mlp,
        "activation_offload": c.activation_offload,
        "compile": c.compile,  # the model's layers compiled before DeepSpeed wraps it
        "kernels": c.kernels,  # Liger's kernels patched into the model (memfit.train.liger.apply)
    }
    return key + "".join(f"|{k}={v}" for k, v in extra.items() if v != getattr(Candidate, k))


# The levers of partitioning and offload, at their "none" values: what `compute_engine` resets.
UNPARTITIONED = {
    "zero": 0,
    "offload_optimizer": "none",
    "offload_param": "none",
    "pin_memory": False,
    "offload_ratio": 1.0,
}


def compute_engine(c: Candidate) -> Candidate:
    """The ZeRO-0 twin of `c` whose micro steps measure its computation alone: the same model
    (checkpointing, attention, adapters, dtype), no partitioning, no offload."""
    return dataclasses.replace(c, **UNPARTITIONED)


def compute_key(method: str, c: Candidate) -> str:
    """One micro step's computation: the model (`compute_engine`'s levers) and the batch it runs:
    method, rows, tokens per row, loss implementation and (DPO, KTO) where the reference comes from."""
    ref = c.ref if method_shape(method).reference else "-"
    key = f"{method}|{engine_key(compute_engine(c))}|mb={c.micro_batch}|seq={c.seq_len}|loss={c.loss_impl}|ref={ref}"
    # the padding-free row is another batch through the same engine (keys of padded ones unchanged)
    return key + ("|padding_free" if c.padding_free else "")
