"""What DeepSpeed's engine adds to a step beyond the kernels' rooflines (memfit.estimate.time.roofline),
for the modelled (uncalibrated) step time: the optimizer step's passes over its states and its
per-tensor host work, ZeRO-2/3's gradient reduce path per micro step, ZeRO-3's gather/release of
every module's parameters per pass, and DeepSpeedCPUAdam's step when the optimizer is offloaded.

Each term is a mechanism of DeepSpeed 0.19 (the source file is named at each term) priced by
bytes at the device's bandwidth or by a host cost per call. Four constants are fitted, all on the
H200's step-time calibration (benchmarks/results/gpu_evidence_h200.json, stage step_time: a
separate process from the evidence rows, 1 and 4 layers of the evidence's model), and checked on
rows never used in a fit: the H100's ten evidence rows, the H200's five, the public table's
(benchmarks/bench_evidence_time.py, benchmarks/bench_public_time.py, docs/time-measurements.md
"Uncalibrated step time on the evidence rows"):

- `ELEMENTWISE_SHARE` and `OPTIMIZER_TENSOR_S`: `runtime.boundary` of the ZeRO-0 engines, full
  and LoRA;
- `ZERO3_MODULE_S` and `ZERO3_MICRO_S`: `runtime.micro` of the ZeRO-3 engine.

Where the device and the host serialise: DeepSpeed's ZeRO-3 coordinator waits on its fetch
events (partitioned_param_coordinator.py `fetch_sub_module`: `__ongoing_fetch_events` ...
`.synchronize()` beyond `__max_ongoing_fetch_events` = 2), so a module's hooks overlap only with
kernels near it (priced per module, `zero3_exposed_host_seconds`); the optimizer's gradient norm
is read on the host (runtime/utils.py `get_global_norm_of_tensors`, `is_invalid_grad_norm`), so
the optimizer's host cost adds to its kernels' time.
"""

from __future__ import annotations

from memfit.estimate.memory.method_terms import grad_seqs, lm_head, nograd_forward_passes
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.models.catalog import GPU
from memfit.estimate.models.params import lora_targets, param_layout
from memfit.estimate.settings import EstimateError, Settings, dtype_bytes
from memfit.estimate.time import roofline
from memfit.space import Candidate

# The share of the copy bandwidth DeepSpeed's optimizer-side element-wise kernels reach (FusedAdam's
# multi_tensor_apply, the norm, the clip, the casts and copies): fitted on the H200's ZeRO-0 boundary,
# full fine-tuning, 1 and 4 layers (0.02829 s, 0.04683 s; gpu_evidence_h200.json step_time) as the
# per-parameter slope after the per-tensor cost below: 1.97e-11 s per parameter at the measured 4,163
# GB/s copy is 82 bytes for the 60 this module counts (`optimizer_bytes_per_param`): 60 / 82.
ELEMENTWISE_SHARE = 0.73

# Host seconds per trainable parameter tensor at the optimizer step (the Python loops of DeepSpeed's
# optimizers and the engine over the parameter groups' tensors: bf16_optimizer.py `update_hp_grads`,
# `get_grads_for_norm`, `clear_lp_grads`; stage_1_and_2.py `get_grad_norm_direct`): fitted on the H200's
# ZeRO-0 LoRA boundary, 1 and 4 layers (14 and 56 adapter tensors, 0.00253 s and 0.01122 s: 0.207 ms a
# tensor; the parameters are too few to cost bandwidth).
OPTIMIZER_TENSOR_S = 2.07e-4

# ZeRO-3's fetch/release of every module's parameters, on the host, per module and pass (forward,
# recompute, backward): DeepSpeed's pre/post hooks (runtime/zero/parameter_offload.py
# `_pre_forward_module_hook`, partitioned_param_coordinator.py `fetch_sub_module` /
# `release_sub_module`, the trace bookkeeping of `record_module`), the backward's gradient hooks
# handing each gradient to `__reduce_and_partition_ipg_grads` (stage3.py). `fetch_sub_module` waits
# on its fetch events beyond `__max_ongoing_fetch_events` (= 2), so the host runs at most a couple
# of modules ahead of the device: a module's host time hides under that module's own kernels and
# only the part beyond them adds (`zero3_exposed_host_seconds`). Short kernels (small models, short
# sequences, norms, LoRA's frozen linears) leave it exposed; long ones (a 7B model's MLP at 1K+
# tokens) hide it. Both constants fitted on the H200's step-time calibration (benchmarks/results/
# gpu_evidence_h200.json, stage step_time, ZeRO-3 `runtime.micro`: what a plain micro step costs
# beyond the ZeRO-0 engine's, 0.02101 s with 1 layer and 0.03890 s with 4 layers of the evidence's
# Llama-3.1-8B, seq 2048, after the gathered copies below): 0.475 ms a module-pass beyond its
# kernels, and 10.4 ms a micro step that hides under nothing (the 1-layer intercept: the epilogue of
# the backward, stage3.py `independent_gradient_partition_epilogue`, synchronises the device).
# Checked on the H100 and H200 sft-full-z3 evidence rows (never fitted) and the public table's
# Qwen-7B ZeRO-3 rows (2 A100s, G = 8; their ~4 s floor at 256 and 512 tokens is this term).
ZERO3_MODULE_S = 4.75e-4
ZERO3_MICRO_S = 1.04e-2


# Bytes per trainable parameter of ZeRO-2/3's gradient reduce path in every micro step, 16-bit
# gradients (d bytes each): the hook's copy into the bucket (read d, write d: stage_1_and_2.py
# `reduce_independent_p_g_buckets_and_remove_grads`; stage3.py `__add_grad_to_ipg_bucket`), the
# pre-division by the world size (`average_tensor` / `__avg_scatter_grads`: read d, write d), and the
# copy of the reduced partition into the gradient partition (`copy_grads_in_partition` / stage3's
# `partition_grads`: read d, write d; fp32 with 4 bytes in stage 3).
def reduce_bytes_per_param(cand: Candidate) -> int:
    d = dtype_bytes(cand.precision)
    return 4 * d + d + (4 if cand.zero == 3 else d)


def optimizer_bytes_per_param(cand: Candidate) -> int:
    """Bytes the device optimizer step moves per parameter of the rank's partition: FusedAdam reads
    the fp32 parameter, gradient, exp_avg and exp_avg_sq and writes three of them back (28;
    ops/csrc/adam/multi_tensor_adam.cu), the gradient norm reads the gradients (4;
    runtime/utils.py `get_global_norm_of_tensors`), the clip scales them in place (8;
    `clip_tensors_by_global_norm`, memfit's trainer clips: train/dsconfig.py gradient_clipping).
    16-bit training adds the gradient's conversion to fp32 (d + 4) and the updated master weights'
    copy into the 16-bit parameters (4 + d; bf16_optimizer.py `update_lp_params`, stage_1_and_2.py /
    stage3.py); ZeRO-0's BF16_Optimizer accumulates every micro step's gradient into an fp32 buffer
    that it clears after the step (`update_hp_grads`, `clear_hp_grads`: 4 + 4 more)."""
    d = dtype_bytes(cand.precision)
    return 28 + 4 + 8 + (0 if d == 4 else 2 * (d + 4) + (8 if cand.zero == 0 else 0))


def trainable_tensors(arch: ModelArch, cand: Candidate, settings: Settings) -> int:
    """Trainable parameter tensors: LoRA's A and B per adapted linear of every layer; full
    fine-tuning every tensor of every decoder layer (params.param_layout) plus the embedding, the
    final norm and an untied head."""
    if cand.finetune != "full":
        return 2 * len(lora_targets(arch, settings)) * arch.num_layers
    layout = param_layout(arch)
    if layout.order:  # a generic card's inventory: every tensor in module order
        return len(layout.order)
    layers = layout.layers or (layout.layer_tensors,) * arch.num_layers
    return sum(len(t) for t in layers) + 2 + (1 if layout.lm_head else 0)


def gathered_modules(arch: ModelArch) -> int:
    """Modules ZeRO-3 fetches and releases in one pass (`module_kernels`)."""
    return len(module_kernels(arch, Candidate(), "sft", None))


def module_kernels(
    arch: ModelArch, cand: Candidate, method: str, r: roofline.Rates | None
) -> list[tuple[float, float]]:
    """(forward, backward) kernel seconds of each module ZeRO-3 fetches and releases in a pass of
    one micro step: per decoder layer its linears (roofline GEMMs; the backward's input gradient,
    and the weight gradient when the weights train), its norms (q/k norms too; no kernel worth
    hiding behind) and, in an MoE layer, the experts module and the router; the embedding, the
    final norm and the head. A generic card's inventory (`units`) lists the modules without shapes:
    every one priced as kernel-free (its whole host time exposed). `r` None: the count only."""
    layout = param_layout(arch)
    if layout.units:
        return [(0.0, 0.0)] * (sum(len(u) for u in layout.units) + 3)
    d = dtype_bytes(cand.precision)
    tokens = grad_seqs(cand, method) * cand.seq_len
    grads = 2 if cand.finetune == "full" else 1

    def gemm(rows: float, n_in: int, n_out: int) -> tuple[float, float]:
        c = roofline.gemm_seconds(rows, n_in, n_out, d, r) if r else 0.0
        return c, grads * c

    norms = [(0.0, 0.0)] * (arch.norms_per_layer + (2 if arch.qk_norm else 0))
    moe = set(arch.moe_layers()) if arch.is_moe else set()
    out: list[tuple[float, float]] = []
    for layer in range(arch.num_layers):
        out += [gemm(tokens, i, o) for _, i, o in layout.layer_linear_shapes(arch, layer)] + norms
        if layer in moe:
            rows = tokens * arch.num_experts_per_tok / arch.num_experts
            per = [gemm(rows, i, o) for i, o in arch.expert_linear_shapes().values()]
            out += [
                tuple(arch.num_experts * sum(x) for x in zip(*per, strict=True)),
                gemm(tokens, *arch.router_shape()),
            ]
    head = arch.vocab_size if lm_head(method) else 1  # a reward model's score: Linear(h, 1)
    return out + [(0.0, 0.0), (0.0, 0.0), gemm(tokens, arch.hidden_size, head)]


def zero3_exposed_host_seconds(arch: ModelArch, cand: Candidate, method: str, r: roofline.Rates) -> float:
    """ZeRO-3's fetch/release host time one micro step adds beyond the kernels: per module and
    pass, `ZERO3_MODULE_S` less that module's own kernels (never below 0), in each forward (the
    recompute and the forwards without gradient too: a reference's, KTO's KL batch) and the
    backward, plus `ZERO3_MICRO_S`."""
    forwards = 1 + (1 if cand.grad_ckpt else 0) + nograd_forward_passes(cand, method)
    h = ZERO3_MODULE_S
    exposed = sum(forwards * max(0.0, h - f) + max(0.0, h - b) for f, b in module_kernels(arch, cand, method, r))
    return ZERO3_MICRO_S + exposed


def optimizer_seconds(
    arch: ModelArch, cand: Candidate, gpu: GPU, trainable: int, world: int, settings: Settings, bandwidth: float
) -> float:
    """The device optimizer's step: its partition's bytes (`optimizer_bytes_per_param`; all the
    parameters at ZeRO-0, 1 / world at ZeRO-1/2/3) at `ELEMENTWISE_SHARE` of `bandwidth` (bytes/s),
    and the host's work per trainable tensor (`OPTIMIZER_TENSOR_S`). Not on the `cpu` device (its
    calibration-free compute term is a fixed MFU)."""
    if gpu.name == "cpu":
        return 0.0
    partition = trainable if cand.zero == 0 else trainable / world
    if not deepspeed_engine(cand, settings):  # a torch optimizer's step: its bytes at the bandwidth
        return (optimizer_bytes_per_param(cand) - 8) * partition / bandwidth
    moved = optimizer_bytes_per_param(cand) * partition / (bandwidth * ELEMENTWISE_SHARE)
    return moved + OPTIMIZER_TENSOR_S * trainable_tensors(arch, cand, settings)


def deepspeed_engine(cand: Candidate, settings: Settings) -> bool:
    """Whether DeepSpeed's engine runs the candidate (memfit's trainer), not a stack these fitted
    host costs were never measured on: PyTorch FSDP for stage 3 (`Settings.zero3_impl`), a plain
    torch optimizer for stage 0 (`Settings.zero0_engine`; the public tables' torchtitan/torchtune
    rows). Those keep the kernels' bytes at the bandwidth and no clip (their configs clip or not)."""
    if cand.zero == 3:
        return settings.zero3_impl == "deepspeed"
    if cand.zero == 0:
        return settings.zero0_engine == "deepspeed"
    return True


def zero_runtime_seconds(
    arch: ModelArch,
    cand: Candidate,
    gpu: GPU,
    method: str,
    trainable: int,
    total: int,
    bandwidth: float,
    settings: Settings,
) -> dict[str, float]:
    """Per optimizer step, what ZeRO-2/3's engine adds to the kernels, by mechanism:

    - `reduce`: ZeRO-2 and 3 hand every micro step's gradients through their buckets
      (`reduce_bytes_per_param` per trainable parameter at `ELEMENTWISE_SHARE` of the bandwidth);
      ZeRO-0 and 1 reduce once, at the boundary, inside the optimizer's passes;
    - `gather`: ZeRO-3 fetches and releases every module's parameters in each pass (forward, the
      recompute under checkpointing, backward, a DPO reference's forward): the 16-bit parameters
      written into the gathered buffer and read (2 d per parameter; partition_parameters.py
      `_allgather_params_coalesced`, also on one rank) and the hooks' host time beyond each
      module's kernels (`zero3_exposed_host_seconds`), every micro step.
    The collectives' wire time between ranks is costs._communication_seconds'."""
    if gpu.name == "cpu" or cand.zero < 2 or not deepspeed_engine(cand, settings):
        return {"reduce": 0.0, "gather": 0.0}
    g = cand.grad_accum
    reduce = g * reduce_bytes_per_param(cand) * trainable / (bandwidth * ELEMENTWISE_SHARE)
    gather = 0.0
    if cand.zero == 3:
        passes = 2 + (1 if cand.grad_ckpt else 0) + nograd_forward_passes(cand, method)
        d = dtype_bytes(cand.precision)
        copies = passes * 2 * d * total / (bandwidth * ELEMENTWISE_SHARE)
        gather = g * (copies + zero3_exposed_host_seconds(arch, cand, method, roofline.rates(gpu, cand.precision)))
    return {"reduce": reduce, "gather": gather}


RUNTIME_LABEL = "DeepSpeed's optimizer, ZeRO-2/3 reduce and ZeRO-3 gather costs fitted on H100/H200 rows"


def cpu_adam_rate(settings: Settings) -> float:
    """Parameters per second one rank's DeepSpeedCPUAdam steps: the per-core rate times the rank's
    cores (`Settings.cpu_adam_params_per_s_per_core`, `Settings.cpu_cores_per_rank`)."""
    return settings.cpu_adam_params_per_s_per_core * settings.cpu_cores_per_rank


def cpu_adam_label(settings: Settings) -> str:
    """The CPU-Adam rate an estimate used, for `Estimate.time_source`."""
    default = Settings()
    said = (
        "default, measured by benchmarks/bench_cpu_adam.py"
        if (settings.cpu_adam_params_per_s_per_core, settings.cpu_cores_per_rank)
        == (default.cpu_adam_params_per_s_per_core, default.cpu_cores_per_rank)
        else "as given: --cpu-adam-rate / --cpu-cores-per-rank, or the config's estimate.cpu_adam_params_per_s_per_core / cpu_cores_per_rank"
    )
    return (
        f"DeepSpeedCPUAdam at {settings.cpu_adam_params_per_s_per_core:.3g} params/s per core x "
        f"{settings.cpu_cores_per_rank} cores per rank ({said})"
    )


CPU_ADAM_KEYS = {"cpu_adam_params_per_s_per_core": float, "cpu_cores_per_rank": int}


def cpu_adam_settings(estimate_cfg: dict) -> dict:
    """The workflow config's `estimate.cpu_adam_params_per_s_per_core` and `estimate.cpu_cores_per_rank`
    as Settings keywords; a value that is not a positive number is refused naming its key."""
    out = {}
    for key, kind in CPU_ADAM_KEYS.items():
        if estimate_cfg.get(key) is None:
            continue
        value = estimate_cfg[key]
        ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
        if kind is int and ok:
            ok = float(value).is_integer()
        if not ok:
            what = "a positive whole number of cores" if kind is int else "a positive rate in parameters per second"
            raise EstimateError(f"estimate.{key}: {value!r} is not {what}")
        out[key] = kind(value)
    return out
