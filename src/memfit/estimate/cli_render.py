"""What `memfit estimate` and `memfit fit` print: the table of one estimate, the configuration it
priced in words, the legend of its terms, and the changes that would make it fit."""

from __future__ import annotations

from memfit.estimate.advice import Option
from memfit.estimate.core import Estimate
from memfit.estimate.memory.method_terms import shape
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.models.catalog import GPU
from memfit.space import Candidate
from memfit.units import GIB, gib

# who loads a checkpoint at resume (Settings.trainer_loader), as the host RAM line names it
LOADER_WORDS = {"memfit": "memfit's trainer", "deepspeed": "DeepSpeed's own load_checkpoint"}

# what the two catch-all terms of the breakdown hold (memfit.estimate.memory.breakdown.peak_breakdown,
# memfit.estimate.memory.overheads.device_overheads and fragmentation)
LEGEND = (
    "temporaries = communication buckets (ZeRO reduce, prefetch), ZeRO-3 gathered parameters, the "
    "optimizer update's and the backward's transient buffers; overheads = allocator fragmentation "
    "(reserved but not allocated), CUDA context, cuBLAS and NCCL memory"
)


# `memfit estimate --explain` and docs/estimator.md's glossary (tests/test_estimate_explain.py keeps the
# two equal): every line of the table, its meaning in one line, and the module that computes it (whose
# docstrings cite the papers, DeepSpeed and PyTorch sources; docs/estimator.md's component table).
GLOSSARY = (
    (
        "params",
        "the model's weights held on this GPU (sharded by ZeRO-3; QLoRA's 4-bit base)",
        "estimate.memory.states",
    ),
    (
        "grads",
        "gradients held on this GPU (16-bit; sharded by ZeRO-2/3; LoRA: the adapter's only)",
        "estimate.memory.states",
    ),
    (
        "optimizer",
        "AdamW's two moments and the fp32 master weights on this GPU (0 when offloaded)",
        "estimate.memory.states (ZeRO paper: 12 bytes per trainable parameter)",
    ),
    (
        "activations",
        "what autograd saves in one micro step for the backward (less with gradient checkpointing)",
        "estimate.memory.activation_memory (Korthikanti et al. 2022), or a traced run",
    ),
    (
        "logits",
        "the head's logits and the loss's fp32 log-softmax (one chunk with chunked loss)",
        "estimate.memory.logits",
    ),
    (
        "reference",
        "DPO's frozen reference copy of the weights (0 with ref precomputed or adapter)",
        "estimate.memory.phases",
    ),
    ("temporaries", LEGEND.split("; ")[0].split(" = ")[1], "estimate.memory.phases, estimate.memory.states"),
    (
        "overheads",
        LEGEND.split("; ")[1].split(" = ")[1],
        "estimate.memory.overheads (a calibration file replaces them)",
    ),
    ("device total", "the sum of the terms above: what nvidia-smi shows for one rank at its peak", "estimate.core"),
    ("allocated", "the tensors inside the total: torch.cuda.max_memory_allocated", "estimate.memory.phases"),
    (
        "reserved",
        "allocated plus the caching allocator's cached free blocks: torch.cuda.max_memory_reserved",
        "estimate.memory.allocator",
    ),
    (
        "usable",
        "the GPU's memory less the headroom kept free for spikes and fragmentation",
        "estimate.models.calibration",
    ),
    (
        "margin",
        "usable less the device total: negative is the shortfall of a config that does not fit",
        "estimate.core",
    ),
    (
        "host RAM per node",
        "each rank's process, offloaded states, pinned buffers, model load and resume",
        "estimate.memory.overheads",
    ),
    (
        "step time",
        "one optimizer step: compute, communication, offload, optimizer and a fixed overhead",
        "estimate.time.costs",
    ),
    ("MFU", "the step's model FLOPs (no recompute) per second over the GPU's peak at the precision", "estimate.core"),
)


def explain() -> str:
    """What `memfit estimate --explain` prints: each term of the table, its meaning, its source."""
    width = max(len(term) for term, _, _ in GLOSSARY)
    lines = ["what each line of `memfit estimate` means (per GPU unless it says otherwise):"]
    lines += [f"  {term:<{width}}  {meaning}  [{source}]" for term, meaning, source in GLOSSARY]
    lines.append("sources and accuracy: docs/estimator.md, 'What it models, its sources, its accuracy'")
    return "\n".join(lines)


def verdict_line(result: Estimate, gpu: GPU) -> str:
    why = []
    limit = result.usable_device_bytes or result.device_memory_bytes
    used = result.device_memory_bytes - result.margin_bytes
    kept = f" with {result.headroom:.0%} headroom" if result.headroom else ""
    if result.headroom and result.headroom_source != "given":
        kept += f" ({result.headroom_source})"
    if used > limit:
        why.append(f"device short by {gib(used - limit)}{kept}")
    else:
        why.append(f"device margin {gib(limit - used)}{kept}")
    if gpu.name != "cpu":
        why.append(
            f"host short by {gib(-result.host_margin_bytes)}"
            if result.host_margin_bytes < 0
            else f"host margin {gib(result.host_margin_bytes)}"
        )
    fits = result.fits_with_headroom if result.usable_device_bytes else result.fits
    return f"verdict: {'FITS' if fits else 'DOES NOT FIT'} ({', '.join(why)})"


def render(
    result: Estimate,
    arch: ModelArch,
    gpu: GPU,
    cand: Candidate,
    num_gpus: int,
    num_nodes: int,
    method: str,
    trainer_loader: str = "memfit",
    legend: bool = False,
) -> str:
    """The human-readable table (`trainer_loader`: whose checkpoint load the resume phases price;
    `legend`: a line saying what `temporaries` and `overheads` hold)."""
    lines = [
        f"{arch.name} {method} {cand.finetune} on {num_nodes}x{num_gpus} {gpu.name}  [{cand.id}]",
        f"params {result.params_total / 1e9:.3f} B total, {result.params_trainable / 1e9:.4f} B trainable",
    ]
    if result.invalid:
        lines.append(f"INVALID: {result.reason}")
        return "\n".join(lines)
    lines.append("")
    source = "; activations traced" if result.activations_source == "traced" else ""
    lines.append(f"per GPU at the peak ({result.peak_phase.replace('_', ' ')}{source}):")
    for component, size in result.breakdown.items():
        lines.append(f"  {component:<14}{gib(size):>14}")
    # the components above sum to the device total (overheads = fragmentation + CUDA context,
    # cuBLAS, NCCL); allocated and reserved are the torch counters inside it
    usable = result.usable_device_bytes or result.device_memory_bytes
    lines += [
        f"  {'-' * 28}",
        f"  {'device total':<14}{gib(result.device_total_bytes):>14}   (nvidia-smi) of "
        f"{gib(usable)} usable"
        + (f" ({gib(result.device_memory_bytes)} less {result.headroom:.0%} headroom)" if result.headroom else ""),
        f"  of which allocated {gib(result.peak_allocated_bytes)} "
        f"(torch.cuda.max_memory_allocated), reserved {gib(result.peak_reserved_bytes)} "
        "(torch.cuda.max_memory_reserved)",
        *([f"  ({LEGEND})"] if legend else []),
        f"peak set by {result.peak_phase.replace('_', ' ')} "
        f"({result.phases[result.peak_phase] / GIB:.1f} GiB allocated); other phases: "
        + ", ".join(f"{k.replace('_', ' ')} {v / GIB:.1f}" for k, v in result.phases.items() if k != result.peak_phase)
        + " GiB",
        f"host RAM per node {gib(result.host_bytes)} of {gib(result.host_memory_bytes)}"
        f"  (peak in {(host_peak := max(result.host_phases, key=result.host_phases.get))}; other phases: "
        + ", ".join(f"{k} {v / GIB:,.1f}" for k, v in result.host_phases.items() if k != host_peak)
        + f" GiB; resume as {LOADER_WORDS[trainer_loader]} loads)",
        f"step time {result.step_time_s:.3f} s  ({result.tokens_per_s:,.0f} tokens/s"
        + (f", MFU {result.mfu:.1%}" if result.mfu is not None else "")
        + "): "
        + ", ".join(f"{k} {v:.3f}" for k, v in result.time_breakdown.items()),
        *(
            ["compute by operation class: " + ", ".join(f"{k} {v:.3f}" for k, v in result.compute_terms.items()) + " s"]
            if result.compute_terms
            else []
        ),
        f"step time source: {result.time_source}",
        f"GPU terms calibration: {result.calibration}",
    ]
    lines += [f"note: {note}" for note in result.notes]
    lines.append(verdict_line(result, gpu))
    return "\n".join(lines)


def describe(cand: Candidate, method: str, lora_targets: tuple[str, ...] | None) -> str:
    """The candidate in words, every lever named (the defaults included)."""
    if cand.finetune == "full":
        tuned = "full fine-tuning"
    else:
        where = ", ".join(lora_targets) if lora_targets else "every linear"
        tuned = f"{'QLoRA' if cand.finetune == 'qlora' else 'LoRA'} r{cand.lora_rank} ({where})"
    parts = [
        method.upper(),
        tuned,
        f"ZeRO-{cand.zero}",
        *(
            ["optimizer offload to cpu" + (f" ({cand.offload_ratio:g})" if cand.offload_ratio != 1 else "")]
            if cand.offload_optimizer != "none"
            else []
        ),
        *(["parameter offload to cpu"] if cand.offload_param != "none" else []),
        *(["pinned host buffers"] if cand.pin_memory else []),
        "gradient checkpointing" if cand.grad_ckpt else "no gradient checkpointing",
        f"{cand.attn} attention",
        f"{cand.loss_impl} loss",
        f"micro batch {cand.micro_batch} x {cand.seq_len:,} tokens",
        f"grad accum {cand.grad_accum}",
        cand.precision,
        *([f"reference: {cand.ref}"] if shape(method).reference else []),
        *([f"sequence parallel {cand.sequence_parallel}"] if cand.sequence_parallel > 1 else []),
        *(["tiled MLP"] if cand.tiled_mlp else []),
        *(["padding-free rows"] if cand.padding_free else []),
        *(["compiled layers"] if cand.compile else []),
        *(["Liger kernels"] if cand.kernels == "liger" else []),
        *(["activation offload"] if cand.activation_offload else []),
    ]
    return ", ".join(parts)


def configuration_lines(config: dict) -> list[str]:
    """The lines after the title: the configuration priced, where host RAM came from, the defaults."""
    host = config["host_memory"]
    lines = [
        f"configuration: {config['words']}",
        f"host RAM {host['bytes'] / GIB:,.2f} GiB per node: {host['source']}",
    ]
    if config["defaults_taken"]:
        lines.append(
            "defaults taken: " + ", ".join(f"{flag} {value}" for flag, value in config["defaults_taken"].items())
        )
    return lines


def _hardware_line(hardware: Option | None) -> list[str]:
    if hardware is None:
        return []
    e = hardware.estimate
    usable = e.usable_device_bytes or e.device_memory_bytes
    return [
        f"or with more GPUs of this kind: {hardware.flags}  peak {e.device_total_bytes / GIB:,.2f} of "
        f"{usable / GIB:,.2f} GiB, step {e.step_time_s:.3f} s, {e.tokens_per_s:,.0f} tokens/s"
    ]


def advice_lines(
    options: list[Option], base: Estimate, fits: bool, what: str | None = None, hardware: Option | None = None
) -> list[str]:
    """The changes that make it fit, each with its peak and speed, fastest (fit: longest) first;
    `hardware`: the fewest GPUs of the same kind that fit, a line of its own."""
    if what is not None:
        if not options:
            return [f"no single lever of memfit's reaches a larger {what}"]
        lines = [f"a larger {what} with one change (memfit's estimate, each alone from this configuration):"]
        for o in options:
            e = o.estimate
            lines.append(
                f"  with {o.flags}: {o.value:,}  (peak {e.device_total_bytes / GIB:,.2f} GiB, "
                f"step {e.step_time_s:.3f} s, {e.tokens_per_s:,.0f} tokens/s)"
            )
        return lines
    if not options:
        return [
            "no single change memfit knows makes it fit: combine two (list them: --zero 2,3 "
            "--finetune lora,qlora ... ranks every combination), add GPUs (--num-gpus, --num-nodes) "
            "or take a larger GPU",
            *_hardware_line(hardware),
        ]
    head = "would make it fit" if not fits else "would make more room"
    lines = [f"{head} (one change from this configuration each, priced by the estimate, fastest first):"]
    usable = base.usable_device_bytes or base.device_memory_bytes
    width = max(len(o.flags) for o in options)
    for o in options:
        e = o.estimate
        cost = ""
        if base.tokens_per_s:
            change = e.tokens_per_s / base.tokens_per_s - 1
            cost = f" ({change:+.0%} tokens/s)"
        lines.append(
            f"  {o.flags:<{width}}  peak {e.device_total_bytes / GIB:,.2f} of {usable / GIB:,.2f} GiB, "
            f"step {e.step_time_s:.3f} s, {e.tokens_per_s:,.0f} tokens/s{cost}"
        )
    return lines + _hardware_line(hardware)
