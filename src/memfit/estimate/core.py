"""`estimate()`: one configuration's prediction, read as phases -> breakdown -> verdict; and
the two searches built on it, `estimate_space` (every candidate) and `fit` (the largest
seq_len or micro_batch that fits)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from memfit.estimate.memory import allocator
from memfit.estimate.memory.activation_memory import Activations, activations
from memfit.estimate.memory.breakdown import peak_breakdown
from memfit.estimate.memory.held_logits import fp32_logits_block
from memfit.estimate.memory.method_terms import METHODS, SEQUENCE_PARALLEL_METHODS, grad_seqs, method_arch, shape
from memfit.estimate.memory.offload_activations import offload_checkpoints
from memfit.estimate.memory.overheads import cached_logits_block, device_overheads, fragmentation, host_memory
from memfit.estimate.memory.phases import step_phases
from memfit.estimate.memory.states import model_states
from memfit.estimate.memory.trainer_terms import apply_trainer_terms
from memfit.estimate.models import calibration
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.models.catalog import GPU
from memfit.estimate.models.generic import generic_arch
from memfit.estimate.models.params import param_layout, trainable_params
from memfit.estimate.models.validity import (
    check_arch,
    hardware_problems,
    model_problems,
    planning_notes,
    unsupported_features,
)
from memfit.estimate.settings import DEFAULT_SETTINGS, EstimateError, Settings
from memfit.estimate.time import timing
from memfit.estimate.time.costs import compute_source, modelled_step, step_flops
from memfit.estimate.time.data_scale import data_time
from memfit.estimate.trace.traced import prefetch_traces, trace_attn, traced_activations, traced_fallback_reason
from memfit.space import Candidate
from memfit.units import GIB


@dataclass
class Estimate:
    """The prediction for one configuration on one rank. Bytes unless the name says otherwise."""

    peak_allocated_bytes: int = 0  # torch.cuda.max_memory_allocated
    peak_reserved_bytes: int = 0  # torch.cuda.max_memory_reserved (allocator caching, fragmentation)
    # what makes reserved exceed the allocated bytes of its phase (memfit.estimate.memory.allocator.Reserved.terms)
    reserved_terms: dict[str, int] = field(default_factory=dict)
    device_total_bytes: int = 0  # nvidia-smi: reserved + CUDA context + workspaces
    device_memory_bytes: int = 0  # the device's whole memory (or the budget)
    host_bytes: int = 0  # host RAM per node at its peak
    host_memory_bytes: int = 0  # the node's RAM
    fits: bool = False
    margin_bytes: int = 0  # device memory minus device_total (negative: short by that much)
    host_margin_bytes: int = 0
    step_time_s: float = 0.0  # one optimizer step (grad_accum micro steps)
    tokens_per_s: float = 0.0  # trained tokens per second over all ranks
    peak_phase: str = ""  # which phase of training holds the peak
    breakdown: dict[str, int] = field(default_factory=dict)  # components at the peak, sum = peak
    phases: dict[str, int] = field(default_factory=dict)  # allocated peak of each phase
    host_breakdown: dict[str, int] = field(default_factory=dict)  # per node at the host peak
    host_phases: dict[str, int] = field(default_factory=dict)
    time_breakdown: dict[str, float] = field(default_factory=dict)
    # the compute term by class (gemm, attention, memory seconds) where the roofline priced it
    compute_terms: dict[str, float] = field(default_factory=dict)
    time_source: str = ""  # "measured <date> on <device> ..." (a calibration) or "assumed: ..." (why)
    mfu: float | None = None  # model FLOPs per second / the GPU's dense peak (None on the cpu: no vendor peak)
    params_total: int = 0
    params_trainable: int = 0
    eager_attention_extra_bytes: int = 0  # eager only: device bytes over the same config with sdpa
    activations_source: str = "analytic"  # "analytic" or "traced" (activation/logit terms)
    calibration: str = calibration.UNCALIBRATED  # "measured <date> on <device>" or uncalibrated
    notes: list[str] = field(default_factory=list)  # what the user should know (said once each)
    invalid: bool = False
    reason: str = ""  # why the hardware cannot run it, when invalid
    # headroom, as the workflow's selection applies it (memfit.estimate.rows.Budget): the fraction of
    # device memory kept free; `fits_with_headroom` compares device_total to the usable part
    headroom: float = 0.0
    # "given" (the caller's headroom) or where the derived margin comes from (calibration.device_margin)
    headroom_source: str = "given"
    usable_device_bytes: int = 0
    fits_with_headroom: bool = False
    step_time_worst_case_s: float | None = None  # priced on the data: its probe's worst-case step (time.data_scale)

    @property
    def training_peak_bytes(self) -> int:
        """The allocated peak over the phases of a step, loading a checkpoint (`resume`) left out:
        what a run that does not resume reaches (a probe, one measured step)."""
        return max((v for k, v in self.phases.items() if k != "resume"), default=self.peak_allocated_bytes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["step_time_worst_case_s"] is None:  # no data statistics: a padded candidate's JSON as it was
            del d["step_time_worst_case_s"]
        return d


@dataclass(frozen=True)
class Job:
    """Where and how a candidate runs: the inputs of `estimate()` besides the candidate."""

    arch: ModelArch
    gpu: GPU
    num_gpus: int  # ranks per node
    num_nodes: int
    method: str  # one of memfit.methods.METHODS (sft, dpo, rm, orpo, simpo, kto)
    host_memory_gb: float | None
    budget_bytes: int | None
    settings: Settings
    headroom: float | None = 0.0  # None: the margin derived from memfit's measured error (calibration.device_margin)

    @property
    def world(self) -> int:
        return self.num_gpus * self.num_nodes


def _estimable(arch: ModelArch) -> ModelArch:
    """A hand-written card with a feature its formulas do not model (DeepSeek's multi-head
    latent attention, an MoE router they do not follow) is estimated as transformers builds it:
    the generic card of the same config (parameters counted, activations traced)."""
    if arch.generic or not unsupported_features(arch):
        return arch
    config = arch.to_hf_config()
    return generic_arch({**config.to_diff_dict(), "model_type": config.model_type}, arch.name, source=arch.source)


def _job_arch(arch: ModelArch, method: str) -> ModelArch:
    """The card estimated: `_estimable`'s, as the method builds it (a reward model's score head:
    method_terms.method_arch); an unknown method is refused by `_check_inputs`."""
    arch = _estimable(arch)
    return method_arch(arch, method) if method in METHODS else arch


def _check_inputs(job: Job, cand: Candidate) -> None:
    if job.method not in METHODS:
        raise EstimateError(f"method must be one of {', '.join(METHODS)}, got {job.method!r}")
    if job.num_gpus < 1 or job.num_nodes < 1:
        raise EstimateError(f"num_gpus and num_nodes must be >= 1, got {job.num_gpus} and {job.num_nodes}")
    if job.headroom is not None and not 0.0 <= job.headroom < 1.0:
        raise EstimateError(f"headroom must be in [0, 1), got {job.headroom}")
    if shape(job.method).reference and cand.ref == "adapter" and cand.finetune == "full":
        raise EstimateError("ref=adapter needs finetune=lora or qlora")
    check_arch(job.arch)


def _one_pool(job: Job) -> bool:
    """On `cpu` the device is the host: one pool, unless the caller gives a per-rank tensor
    budget (the workflow's `cpu_memory_mib`), which is then checked like a GPU's memory."""
    return job.gpu.name == "cpu" and job.budget_bytes is None


def _activation_terms(job: Job, cand: Candidate, est: Estimate) -> Activations:
    """Analytic activations, or traced ones (with what the trace could not run said in a note)."""
    settings = job.settings
    analytic = activations(job.arch, cand, job.method, settings)
    if settings.activations == "analytic" and not job.arch.generic:
        return analytic
    if settings.activations not in ("traced", "analytic"):
        raise EstimateError(f"activations must be analytic or traced, got {settings.activations!r}")
    fallback = traced_fallback_reason(job.arch, cand, settings)  # MoE cases the trace misses
    if job.arch.generic:
        est.notes.append(
            f"{job.arch.model_type}: parameters counted on transformers' own model, activations "
            f"traced (memfit has no formulas for this architecture)"
        )
    elif fallback:
        est.notes.append(f"activations from the formulas, not traced: {fallback}")
        return analytic
    traced = traced_activations(job.arch, cand, job.method, settings, analytic)
    est.activations_source = "traced"
    if cand.attn == "flash" and trace_attn(job.arch, cand.attn) == "eager":
        est.notes.append(
            f"activations traced with eager attention: FlashAttention-2 cannot run on the CPU and "
            f"{job.arch.model_type} has no SDPA path; its materialised scores make this an upper bound"
        )
    elif cand.attn == "flash":
        est.notes.append(
            "activations traced with sdpa: FlashAttention-2 cannot run on the CPU; SDPA's CPU "
            "kernel keeps the same tensors (output and log-sum-exp)"
        )
    if cand.finetune == "qlora":
        est.notes.append("activations traced as LoRA: bitsandbytes' 4-bit kernels need CUDA")
    return traced


def _eager_attention_cost(job: Job, cand: Candidate, est: Estimate) -> None:
    """What the materialised scores cost: the same configuration with a fused kernel."""
    fused = _estimate(job, dataclasses.replace(cand, attn="sdpa"))
    est.eager_attention_extra_bytes = est.device_total_bytes - fused.device_total_bytes
    kept = "one recomputed layer's" if cand.grad_ckpt else "every layer's"
    est.notes.append(
        f"eager attention keeps {kept} {cand.seq_len}x{cand.seq_len} attention probabilities: "
        f"+{est.eager_attention_extra_bytes / GIB:.2f} GiB on the device versus sdpa/flash"
    )


def _verdict(job: Job, est: Estimate) -> None:
    """Margins and whether it fits: device and host separately, or one pool on `cpu`."""
    if _one_pool(job):
        # the "device" is the host: every rank's peak plus the processes' own memory
        need = job.num_gpus * est.device_total_bytes + est.host_bytes
        est.margin_bytes = est.device_memory_bytes - need
        est.host_margin_bytes = est.margin_bytes
        est.fits = est.margin_bytes >= 0
    else:
        est.margin_bytes = est.device_memory_bytes - est.device_total_bytes
        est.host_margin_bytes = est.host_memory_bytes - est.host_bytes
        est.fits = est.margin_bytes >= 0 and est.host_margin_bytes >= 0
    # the same rule as memfit.estimate.rows.Budget.device_limit_bytes
    est.headroom = job.headroom
    if job.headroom is None:  # no headroom given: the margin memfit's own device-total error calls for
        cal = calibration.for_gpu(job.gpu.name, job.gpu.compute_capability)
        est.headroom, est.headroom_source = calibration.device_margin(cal)
    est.usable_device_bytes = int(est.device_memory_bytes * (1.0 - est.headroom))
    used = est.device_memory_bytes - est.margin_bytes
    est.fits_with_headroom = est.fits and used <= est.usable_device_bytes and est.host_margin_bytes >= 0


def per_rank(cand: Candidate) -> Candidate:
    """The sequence a rank computes on: with Ulysses sequence parallelism (DeepSpeed ALST) each
    rank of a group holds seq_len / SP tokens of every sequence through the layers (padded to a
    multiple, memfit.train.sequence_parallel.shard_batch), and its attention all the tokens of
    heads / SP heads: the same activations as seq_len / SP tokens of every head (a fused
    kernel's q, k, v, output and log-sum-exp are linear in tokens x heads). Its attention FLOPs
    are 1/SP of the whole sequence's (costs.step_flops attends over seq_len x SP), and the
    all-to-all adds time (costs.ulysses_seconds) and transient buffers within the layer's own.
    `sequence_parallel` stays set for both."""
    sp = cand.sequence_parallel
    return cand if sp == 1 else dataclasses.replace(cand, seq_len=-(-cand.seq_len // sp))


def _estimate(job: Job, cand: Candidate) -> Estimate:
    _check_inputs(job, cand)
    arch, gpu, settings, world = job.arch, job.gpu, job.settings, job.world
    trainable = trainable_params(arch, cand, settings)
    est = Estimate(params_total=param_layout(arch).total, params_trainable=trainable)
    est.notes += planning_notes(gpu, arch, cand, settings)  # planning-only GPU; what MoE leaves out
    host_gb = job.host_memory_gb if job.host_memory_gb is not None else gpu.typical_host_memory_gb
    budget = job.budget_bytes
    est.device_memory_bytes = int(budget if budget is not None else gpu.memory_bytes)
    est.host_memory_bytes = est.device_memory_bytes if _one_pool(job) else int(host_gb * 1e9)
    problems = hardware_problems(gpu, cand) + model_problems(arch, cand)
    if world % cand.sequence_parallel:
        problems.append(f"sequence_parallel {cand.sequence_parallel} does not divide the {world} ranks")
    if cand.sequence_parallel > 1 and job.method not in SEQUENCE_PARALLEL_METHODS:
        problems.append(f"{job.method} does not run under sequence parallelism (sequence_parallel: 1)")
    if problems:
        est.invalid, est.reason = True, "; ".join(problems)
        return est
    full, cand = cand, per_rank(cand)  # what one rank computes: its share of each sequence

    # phases: what each phase of a step allocates; the largest is the peak
    states = model_states(arch, cand, world, settings, job.method)
    acts = apply_trainer_terms(_activation_terms(job, cand, est), arch, cand, job.method, settings)
    acts_host = 0 if gpu.name == "cpu" else offload_checkpoints(acts, arch, cand, job.method)
    if gpu.name == "cpu" and cand.activation_offload:
        est.notes.append(
            "activation_offload on the cpu moves nothing: the host is the device (DeepSpeed's "
            "offload skips a device without streams, offload_activations.py `_should_skip`)"
        )
    est.notes += states.notes
    cal = calibration.for_gpu(gpu.name, gpu.compute_capability)
    workspaces = calibration.allocator_workspaces(cal, gpu.compute_capability)
    phases = step_phases(
        arch, cand, states, acts, trainable, world, settings, host_device=gpu.name == "cpu", workspaces=workspaces
    )
    est.phases = phases.allocated
    est.peak_phase = phases.peak_phase
    est.peak_allocated_bytes = phases.allocated[est.peak_phase]

    # breakdown: the peak's components; reserved adds fragmentation of the shape-varying part,
    # nvidia-smi's total the CUDA context, cuBLAS and NCCL
    breakdown = peak_breakdown(phases, states, acts, cand, job.method, trainable, world)
    if est.peak_phase != "resume":  # a resumed process has run no GEMM before its first step
        breakdown["temporaries"] += workspaces
    _reserved(job, cand, est, phases, states, acts, cal)
    fragmented = est.peak_reserved_bytes - est.peak_allocated_bytes
    est.calibration = cal.label()
    overheads = sum(device_overheads(gpu, world, settings).values())
    est.device_total_bytes = est.peak_reserved_bytes + overheads
    breakdown["overheads"] = fragmented + overheads
    est.breakdown = {k: int(v) for k, v in breakdown.items()}
    if cand.attn == "eager" and not model_problems(arch, dataclasses.replace(cand, attn="sdpa")):
        _eager_attention_cost(job, cand, est)
    host = host_memory(arch, cand, gpu, states, job.num_gpus, world, settings, acts_host)
    est.host_breakdown, est.host_phases, est.host_bytes = host.breakdown, host.phases, host.peak

    # verdict: fits or not, and how fast
    _verdict(job, est)
    est.time_breakdown, est.time_source, terms = _step_time(job, arch, cand, gpu, states, settings)
    data_time(arch, cand, job.method, settings, est, terms)  # the data's rows, not the probes' worst case
    est.compute_terms = {k: round(v, 6) for k, v in terms.items()}
    est.step_time_s = round(sum(est.time_breakdown.values()), 6)
    # the sequences a row trains on (a pair's two; not KTO's KL batch), as the trainer counts tokens/s
    sequences = grad_seqs(full, job.method)
    tokens = sequences * full.seq_len * full.grad_accum * full.data_parallel(world)
    est.tokens_per_s = tokens / est.step_time_s if est.step_time_s > 0 else 0.0
    peak = gpu.tflops(cand.precision) * 1e12
    if gpu.name != "cpu" and peak > 0 and est.step_time_s > 0:  # the cpu entry's peak is a placeholder
        est.mfu = step_flops(arch, cand, job.method, recompute=False, settings=job.settings) / (est.step_time_s * peak)
    return est


def _reserved(job: Job, cand: Candidate, est: Estimate, phases, states, acts, cal) -> None:
    """Reserved memory at the peak: the caching allocator's segments, from its mechanisms
    (memfit.estimate.memory.allocator); the host has no caching allocator."""
    transient = acts.saved + acts.logits_bwd_extra + acts.layer_bwd + acts.recompute
    logits_block = fp32_logits_block(job.arch, cand, job.method, job.settings)
    if job.gpu.name == "cpu":  # no caching allocator on the host
        est.peak_reserved_bytes = est.peak_allocated_bytes
    elif not cal.measured and job.settings.logits_handling != "memfit":
        # another trainer's loss code (public rows) on a GPU without a calibration keeps the stated
        # heuristic (8%/30% of the shape-varying bytes plus the whole fp32 logits block): the
        # allocator's logits mechanism is memfit's trainer's allocation order (the next forward's
        # 16-bit logits carved out of the freed fp32 block); other trainers allocate more [t, V]
        # blocks in another order, and the mechanism model put their A100/RTX 4090 rows up to 15%
        # low (docs/measurements.md)
        est.peak_reserved_bytes = (
            est.peak_allocated_bytes
            + fragmentation(transient, job.settings, False)
            + cached_logits_block(logits_block, job.settings, False)
        )
    else:  # memfit's trainer, or a calibrated GPU: the mechanisms (cited defaults where no file measured them)
        held = allocator.reserved(
            phases, states, cand, job.world, logits_block, transient, job.settings, cal.logits_cached_share
        )
        est.peak_reserved_bytes = max(held.bytes, est.peak_allocated_bytes)
        est.reserved_terms = held.terms


def _step_time(
    job, arch: ModelArch, cand: Candidate, gpu: GPU, states, settings: Settings
) -> tuple[dict[str, float], str, dict[str, float]]:
    """Seconds per optimizer step by term, where they come from, and the compute term by
    operation class (empty unless the roofline priced it): the machine's calibration
    (memfit.estimate.time.timing) when `settings.step_time_calibration` has this candidate on this
    world size, else the modelled step (costs.modelled_step, its source stated)."""
    why = "no calibration measured (the calibrate stage measures one where probes run)"
    if settings.step_time_calibration:
        cal = timing.load(settings.step_time_calibration)
        world = job.num_gpus * job.num_nodes
        # a calibration of another model shape, GPU, world size or backend is not this one's (#41)
        why = timing.refusal(cal, arch, gpu.name, world) or timing.missing(cal, cand, job.method) or ""
        if not why:
            return timing.predict(cal, cand, job.method, arch.num_layers), cal.label(arch.num_layers), {}
    breakdown, terms = modelled_step(arch, cand, gpu, job.method, job.num_gpus, job.num_nodes, states, settings)
    return breakdown, f"{compute_source(arch, cand, gpu, settings)}: {why}", terms


def estimate(
    arch: ModelArch,
    gpu: GPU,
    num_gpus: int = 1,
    num_nodes: int = 1,
    method: str = "sft",
    cand: Candidate | None = None,
    host_memory_gb: float | None = None,
    budget_bytes: int | None = None,
    settings: Settings = DEFAULT_SETTINGS,
    headroom: float | None = 0.0,
) -> Estimate:
    """Predict one configuration on `num_gpus` GPUs per node x `num_nodes` nodes.

    `budget_bytes` replaces the device's memory (the demo's `cpu` entry). `headroom` is the
    fraction of it kept free, as in `memfit.estimate.rows.Budget`: `fits_with_headroom` applies it;
    None keeps the margin memfit's own measured device-total error calls for on this GPU
    (`calibration.device_margin`, said in `headroom_source`). Invalid hardware combinations return
    `Estimate(invalid=True, reason=...)`; bad input raises `EstimateError`.
    """
    job = Job(
        _job_arch(arch, method), gpu, num_gpus, num_nodes, method, host_memory_gb, budget_bytes, settings, headroom
    )
    return _estimate(job, cand or Candidate())


def estimate_space(
    arch: ModelArch,
    gpu: GPU,
    num_gpus: int,
    num_nodes: int,
    method: str,
    candidates,
    host_memory_gb: float | None = None,
    budget_bytes: int | None = None,
    settings: Settings = DEFAULT_SETTINGS,
) -> list[dict[str, Any]]:
    """`estimate()` of every candidate: the estimate JSON plus "candidate" and "id"."""
    candidates = list(candidates)
    if settings.activations == "traced":
        prefetch_traces(arch, gpu, candidates, settings)
    job = Job(_job_arch(arch, method), gpu, num_gpus, num_nodes, method, host_memory_gb, budget_bytes, settings)
    rows = []
    for cand in candidates:
        row = _estimate(job, cand).to_dict()
        row["candidate"] = cand.to_dict()
        row["id"] = cand.id
        rows.append(row)
    return rows
