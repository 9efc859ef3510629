"""What would make a configuration fit, found by the estimator: memfit's levers tried one at a
time from the user's own configuration, each priced by the same estimate, those that fit listed
fastest first with the flags to pass.

    options = advise(price, cand, base, arch, world=1, method="sft")
    options[0].flags, options[0].estimate.device_total_bytes   # "--loss-impl chunked", ...

`price(cand) -> Estimate` is the caller's estimate of a candidate on its job (model, GPUs, budget,
headroom); `search(cand) -> (value, Estimate)` (for `advise_fit`) its `memfit fit` search. A lever
that the hardware or DeepSpeed cannot run (an invalid estimate, a refused combination) is left out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from memfit.estimate.core import Estimate
from memfit.estimate.memory.method_terms import shape
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.search import largest_fitting, sequence_parallel_sizes
from memfit.space import Candidate

# A configuration that fits with less than this share of its usable device memory left (after the
# headroom) gets the levers that lower its peak too. A stated threshold, not a measurement: the
# headroom already holds memfit's measured error, this is the room a user may want for more.
LITTLE_ROOM = 0.05
MIN_SEQ_LEN = 2  # the next-token loss needs two tokens (memfit.estimate.fit.MIN_SEQ_LEN)


@dataclass
class Option:
    """One change from the user's configuration: the flags that make it, the candidate, its
    estimate; `value` is the maximized seq_len or micro batch with it (`advise_fit` only)."""

    flags: str
    cand: Candidate
    estimate: Estimate
    value: int | None = None

    def to_dict(self, base: Estimate | None = None) -> dict:
        e = self.estimate
        out = {
            "flags": self.flags,
            "device_total_bytes": e.device_total_bytes,
            "usable_device_bytes": e.usable_device_bytes or e.device_memory_bytes,
            "host_bytes": e.host_bytes,
            "step_time_s": e.step_time_s,
            "tokens_per_s": e.tokens_per_s,
            "candidate": self.cand.to_dict(),
        }
        if base is not None and base.tokens_per_s:
            out["throughput_change"] = round(e.tokens_per_s / base.tokens_per_s - 1, 6)
        if self.value is not None:
            out["value"] = self.value
        return out


def default_ref(finetune: str, method: str) -> str | None:
    """The reference when none is given (DPO, KTO): the frozen model for full fine-tuning, the
    model without its adapter for LoRA; the methods without one (sft, rm, orpo, simpo) None, as
    the workflow's candidates."""
    if not shape(method).reference:
        return None
    return "model" if finetune == "full" else "adapter"


def needs_advice(est: Estimate) -> bool:
    """Whether `est` does not fit, or fits with less than LITTLE_ROOM of its usable memory left."""
    if est.invalid:
        return False
    if not est.fits_with_headroom:
        return True
    usable = est.usable_device_bytes or est.device_memory_bytes
    return usable - est.device_total_bytes < LITTLE_ROOM * usable


def _with(cand: Candidate, **changes) -> Candidate | None:
    try:
        return dataclasses.replace(cand, **changes)
    except ValueError:  # a combination DeepSpeed or peft cannot run (Candidate.problems)
        return None


def flags_between(cand: Candidate, new: Candidate) -> str:
    """The command-line flags that turn `cand` into `new`, in the parser's spelling."""
    words = []
    order = ("zero", "offload_optimizer", "offload_param", "finetune", "loss_impl", "grad_ckpt")
    order += ("sequence_parallel", "micro_batch", "grad_accum", "seq_len", "ref")
    for name in order:
        a, b = getattr(cand, name), getattr(new, name)
        if a == b:
            continue
        if name == "grad_ckpt":
            words.append("--grad-ckpt" if b else "--no-grad-ckpt")
        else:
            words.append(f"--{name.replace('_', '-')} {b}")
    return " ".join(words)


def levers(cand: Candidate, arch: ModelArch, world: int, method: str, ref_given: bool = False) -> list[Candidate]:
    """The one-lever changes of `cand` memfit knows that lower memory (without the searched ones:
    a smaller micro batch and a shorter sequence, see `advise`)."""
    out: list[Candidate | None] = []
    if cand.loss_impl == "full" and shape(method).head == "lm":  # a reward model has no vocabulary loss
        out.append(_with(cand, loss_impl="chunked"))
    if not cand.grad_ckpt:
        out.append(_with(cand, grad_ckpt=True))
    out += [_with(cand, zero=z) for z in range(cand.zero + 1, 4)]
    kinds = {"full": ("lora", "qlora"), "lora": ("qlora",), "qlora": ()}[cand.finetune]
    for kind in kinds:
        ref = cand.ref if (shape(method).reference and ref_given) else default_ref(kind, method)
        out.append(_with(cand, finetune=kind, ref=ref))
    if cand.offload_optimizer == "none":
        out.append(_with(cand, zero=max(cand.zero, 2), offload_optimizer="cpu"))
    if cand.offload_param == "none":
        out.append(_with(cand, zero=3, offload_optimizer="cpu", offload_param="cpu"))
    for sp in sequence_parallel_sizes(arch, world):
        if sp > cand.sequence_parallel:
            out.append(_with(cand, sequence_parallel=sp))
    return [c for c in dict.fromkeys(out) if c is not None and c != cand]


def _smaller_batch(cand: Candidate, mb: int) -> Candidate:
    """`cand` at micro batch `mb`, its grad_accum raised to keep the global batch where it divides."""
    rows = cand.micro_batch * cand.grad_accum
    accum = rows // mb if rows % mb == 0 else cand.grad_accum
    return dataclasses.replace(cand, micro_batch=mb, grad_accum=accum)


def advise(
    price: Callable[[Candidate], Estimate],
    cand: Candidate,
    base: Estimate,
    arch: ModelArch,
    world: int,
    method: str,
    ref_given: bool = False,
) -> list[Option]:
    """The single changes of `cand` that fit (when `base` fits with little room: that also lower
    its peak), fastest first. Each lever keeps only its cheapest fitting setting (the lowest ZeRO
    stage, the smallest sequence-parallel group, the largest smaller micro batch, the longest
    shorter sequence: `search.largest_fitting`, the search `memfit fit` runs)."""
    if base.invalid:
        return []
    found: dict[str, Option] = {}

    def keep(kind: str, new: Candidate, est: Estimate) -> None:
        if est.invalid or not est.fits_with_headroom:
            return
        if base.fits_with_headroom and est.device_total_bytes >= base.device_total_bytes:
            return  # fits already: only a lever that makes room counts
        if kind not in found:  # the first fitting setting of a lever is its cheapest
            found[kind] = Option(flags_between(cand, new), new, est)

    for new in levers(cand, arch, world, method, ref_given):
        kind = _kind(cand, new)
        if kind not in found:
            keep(kind, new, price(new))
    if base.fits_with_headroom:  # room, not a fit: one token or row less makes none worth saying
        return sorted(found.values(), key=lambda o: -o.estimate.tokens_per_s)
    if cand.micro_batch > 1:
        mb, est = largest_fitting(lambda n: price(_smaller_batch(cand, n)), 1, cand.micro_batch - 1)
        if mb:
            keep("micro_batch", _smaller_batch(cand, mb), est)
    if cand.seq_len > MIN_SEQ_LEN:
        n, est = largest_fitting(lambda n: price(dataclasses.replace(cand, seq_len=n)), MIN_SEQ_LEN, cand.seq_len - 1)
        if n:
            keep("seq_len", dataclasses.replace(cand, seq_len=n), est)
    return sorted(found.values(), key=lambda o: -o.estimate.tokens_per_s)


def _kind(cand: Candidate, new: Candidate) -> str:
    """Which lever `new` pulls (ZeRO stages and group sizes are settings of one lever each)."""
    if new.offload_param != cand.offload_param:
        return "offload_param"
    if new.offload_optimizer != cand.offload_optimizer:
        return "offload_optimizer"
    if new.finetune != cand.finetune:
        return f"finetune={new.finetune}"
    for name in ("loss_impl", "grad_ckpt", "zero", "sequence_parallel"):
        if getattr(new, name) != getattr(cand, name):
            return name
    return flags_between(cand, new)


def advise_fit(
    search: Callable[[Candidate], tuple[int, Estimate | None]],
    cand: Candidate,
    what: str,
    best: int,
    arch: ModelArch,
    world: int,
    method: str,
    ref_given: bool = False,
) -> list[Option]:
    """`memfit fit`'s advice: each lever's own largest `what` ("seq_len" or "micro_batch"), kept
    where it beats `best` (the user's configuration's), the longest first."""
    found: dict[str, Option] = {}
    for new in levers(cand, arch, world, method, ref_given):
        kind = _kind(cand, new)
        if kind in found:
            continue
        value, est = search(new)
        if value > best and est is not None and not est.invalid:
            found[kind] = Option(flags_between(cand, new), dataclasses.replace(new, **{what: value}), est, value)
    if what == "seq_len" and cand.micro_batch > 1:
        smaller = _smaller_batch(cand, 1)
        value, est = search(smaller)
        if value > best and est is not None and not est.invalid:
            found["micro_batch"] = Option(flags_between(cand, smaller), smaller, est, value)
    return sorted(found.values(), key=lambda o: (-(o.value or 0), -o.estimate.tokens_per_s))


# How many nodes `more_gpus` tries at most, as the workflow's own hint when nothing fits
# (memfit.workflow.pipeline.MAX_NODES_HINT): a few estimates, not a search of the cluster.
MAX_NODES = 16


def more_gpus(
    price_on: Callable[[Candidate, int, int], Estimate],
    cand: Candidate,
    num_gpus: int,
    num_nodes: int,
    gpus_per_node: int,
) -> Option | None:
    """The fewest GPUs of the same kind that fit `cand` (None: not within MAX_NODES nodes): more
    GPUs on the node, doubling up to `gpus_per_node` (what one node of this GPU holds, the
    catalog's typical node), then more such nodes. Below ZeRO-1 nothing is split across GPUs, so
    the candidate moves to ZeRO-3 there (the flags say so). `price_on(cand, num_gpus, num_nodes)`."""
    new = cand if cand.zero > 0 else dataclasses.replace(cand, zero=3)
    shapes = []
    n = num_gpus * 2
    while num_nodes == 1 and n <= max(gpus_per_node, num_gpus):
        shapes.append((n, 1))
        n *= 2
    per_node = max(gpus_per_node, num_gpus)
    shapes += [(per_node, k) for k in range(num_nodes + 1, MAX_NODES + 1)]
    for gpus, nodes in shapes:
        if (gpus * nodes) % new.sequence_parallel:
            continue
        est = price_on(new, gpus, nodes)
        if not est.invalid and est.fits_with_headroom:
            flags = [f"--num-gpus {gpus}"] if gpus != num_gpus else []
            flags += [f"--num-nodes {nodes}"] if nodes != num_nodes else []
            flags += [flags_between(cand, new)] if new != cand else []
            return Option(" ".join(flags), new, est)
    return None
