"""Step-time calibration: what a training step costs on this machine, measured with the model's
own code, DeepSpeed's own engine and the real backend, on every rank of the job's world.

`python -m memfit.cli calibrate --spec spec.json` runs on each rank (started by `memfit.train.launch`,
which sets the rank's threads as training does). The spec names the model directory, the
candidates of each method and the run settings (`memfit.workflow.calibrate` writes it). The model
is rebuilt with 1 and with 4 decoder layers, and whole where that is cheap; a model of at most 4
layers is measured whole only (`depths`; random weights: time does not depend on their values),
and for each layer count:

- **computation** (`compute`): for every ZeRO-0 engine the candidates need (`space.compute_engine`:
  same model, checkpointing, adapters and dtype, no partitioning) the seconds of one micro step
  (`StepRunner.loss` + `engine.backward`, away from the accumulation boundary, where ZeRO-0 does
  nothing but the model's own forward and backward) at every batch shape (`space.compute_key`:
  rows, tokens, loss implementation, DPO reference);
- **DeepSpeed's runtime** (`runtime`, per `space.engine_key`): `micro`, what a micro step of that
  engine costs beyond the computation (ZeRO-2's gradient reduce per bucket, ZeRO-3's parameter
  gather/release per module, offload copies), measured at the smallest SFT shape and the ZeRO-0
  time of that shape subtracted; `boundary`, what the micro step at the accumulation boundary
  costs beyond a plain one (ZeRO-0/1's all-reduce, the optimizer step, ZeRO-1/2's all-gather of
  the updated partitions, gradient clipping); `ref`, with a ZeRO-3 DPO reference, its per-module
  gathers in the reference forward.

- **DeepSpeedCPUAdam** (`cpu_adam`, only when a candidate offloads its optimizer): every rank at
  once steps a DeepSpeedCPUAdam over a block of CPU_ADAM_BLOCK fp32 parameters on its own threads
  (the cores a training rank gets), as the ranks of a node step their partitions together; the
  block's parameters per second of the slowest rank price an offloaded optimizer step
  (memfit.estimate.time.costs).

Each figure is the median of `reps` repetitions after two warm-up optimizer steps (the first
steps allocate the optimizer state and build DeepSpeed's buckets), and the maximum over ranks
(a step waits for its slowest rank). On the CPU the steps run under the `AllocationTracker`,
as training and probes do (its per-op bookkeeping is part of a CPU step's cost).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from memfit.atomic import write_json_atomic
from memfit.methods import REFERENCE_METHODS
from memfit.space import UNPARTITIONED, Candidate, compute_engine, compute_key, engine_key
from memfit.train import determinism, dsconfig, long_context
from memfit.train import dist as dist_env
from memfit.train.batches import IGNORE_INDEX
from memfit.train.calibrate_cpu_adam import CPU_ADAM_BLOCK, cpu_adam_figure, cpu_adam_seconds, wants_cpu_adam
from memfit.train.device_info import device_identity
from memfit.train.memory import AllocationTracker
from memfit.train.modeling import hidden_size, load_model
from memfit.train.reference import reference_engine
from memfit.train.steps import StepRunner

FORMAT = 1  # bump when what a calibration file holds changes (memfit.estimate.time.timing reads it)
# a deeper model is measured with 1 and with MAX_LAYERS decoder layers: per layer = (x(n) - x(1)) / (n - 1);
# n > 2 divides the noise of the two timings by n - 1 when extrapolating to a deep model. A model of
# at most MAX_LAYERS layers is measured whole, at its own depth only (`depths`).
MAX_LAYERS = 4
WHOLE_MODEL_S = 180.0  # `depths`: the 24-layer GPU demo from 1 and 4 layers was priced 1.6-2.0x long on an H200 (#42)
WHOLE_MODEL_MEMORY = 0.5  # of the device: the n-layer peak scaled to the model whole (embeddings too: an overestimate)
WARMUP_STEPS = 2  # optimizer steps before timing: the first allocates Adam's state and DeepSpeed's buckets


@dataclasses.dataclass(frozen=True)
class Spec:
    """What to calibrate: written by memfit.workflow.calibrate as JSON."""

    model_path: str  # HF model directory (config.json); its weights are not read
    out: str  # calibration.json (rank 0 writes it)
    work_dir: str  # scratch directory on a filesystem every rank sees (the 1- and 2-layer models)
    candidates: dict[str, list[dict[str, Any]]]  # method -> Candidate dicts
    lora: dict[str, Any] = dataclasses.field(default_factory=dict)  # alpha, dropout, targets
    qlora_quant_type: str = "nf4"
    dpo: dict[str, Any] = dataclasses.field(default_factory=dict)  # DPOConfig fields
    pref: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # orpo/simpo/kto -> TRL-named fields
    loss_on: str = "response"
    loss_chunk_tokens: int | None = None
    mlp_tile_tokens: int | None = None
    deterministic: bool = False  # train.deterministic: the kernels training runs (memfit.train.determinism)
    reps: int = 5  # repetitions per figure (median); 3 left single slow samples in the demo's figures
    # what the figures are of (memfit.estimate.time.timing.model_identity: name, depth, layer-shape SHA-256),
    # written by memfit.workflow.calibrate; recorded in the file, and the estimator refuses the
    # figures for another model shape (#41). {}: not recorded, and the estimator refuses the file.
    model: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> Spec:
        return cls(**json.loads(Path(path).read_text()))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _rows(method: str, c: Candidate, vocab: int) -> list[dict[str, Any]]:
    """A micro batch of `c.micro_batch` rows of exactly `c.seq_len` tokens (the probes' worst case:
    no padding); half prompt, half response. DPO and KTO rows carry zero precomputed reference
    log-probs; KTO rows alternate desirable and undesirable, each with its own KL completion."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(c.micro_batch):
        ids = torch.randint(3, vocab, (c.seq_len,), generator=g).tolist()
        half = c.seq_len // 2
        if method == "sft":
            out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * half + ids[half:]})
        elif method == "kto":
            kl = torch.randint(3, vocab, (c.seq_len - half,), generator=g).tolist()
            row = {"prompt_ids": ids[:half], "completion_ids": ids[half:], "label": i % 2 == 0}
            out.append(row | {"kl_completion_ids": kl, "ref_logps": 0.0, "ref_KL_logps": 0.0})
        else:
            alt = torch.randint(3, vocab, (c.seq_len - half,), generator=g).tolist()
            out.append(
                {
                    "prompt_ids": ids[:half],
                    "chosen_ids": ids[half:],
                    "rejected_ids": alt,
                    "ref_chosen_logps": 0.0,
                    "ref_rejected_logps": 0.0,
                }
            )
    return out


def _layer_model(spec: Spec, layers: int) -> str:
    """The spec's model with `layers` decoder layers, random weights, saved once (rank 0) where all
    ranks read it. Per-layer lists of the config (`layer_types`: sliding vs full attention ...)
    are cut to the same length."""
    path = Path(spec.work_dir) / f"layers{layers}"
    if dist_env.rank() == 0:
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.from_pretrained(spec.model_path)
        cfg.num_hidden_layers = layers
        if isinstance(getattr(cfg, "layer_types", None), list):
            cfg.layer_types = cfg.layer_types[:layers]
        # in the checkpoint's dtype (bf16 for most): half the bytes to write and read of fp32
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(cfg, "dtype", None) or torch.float32)
        shutil.rmtree(path, ignore_errors=True)
        model.save_pretrained(path)
    dist_env.barrier()
    return str(path)


def _num_layers(model_path: str) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model_path).num_hidden_layers)


class _Engine:
    """One DeepSpeed engine of the calibration (gradient accumulation 2: boundary every other micro step)."""

    def __init__(self, spec: Spec, path: str, cand: Candidate, with_ref: bool, score: bool = False) -> None:
        """`score`: a reward model (rm's sequence-classification model, memfit.train.preference.rm)."""
        import deepspeed

        self.cand = dataclasses.replace(cand, grad_accum=2)
        world = dist_env.world()
        ds_cfg = dsconfig.build(self.cand, world, lr=1e-5, total_steps=1000, hidden_size=hidden_size(path))
        hf_ds = None
        if cand.zero == 3:
            from transformers.integrations import HfDeepSpeedConfig

            hf_ds = HfDeepSpeedConfig(ds_cfg)  # partitioned as it loads, as training does (loop.Run.setup)
        # spec.lora holds RunConfig's alpha/dropout/targets; load_model applies their defaults
        model = load_model(
            path,
            self.cand,
            trainable=True,
            lora=spec.lora,
            quant_type=spec.qlora_quant_type,
            score_pad_id=0 if score else None,  # the rows hold no padding: token ids start at 3 (`_rows`)
        )
        long_context.prepare(model, self.cand, spec.mlp_tile_tokens)
        if cand.compile:  # search.compile: the engine's layers compiled as training compiles them
            from memfit.train.compile import compile_layers

            compile_layers(model)  # compiles at the warm-up steps, left out of every figure
        self.vocab = int(model.get_input_embeddings().num_embeddings)
        params = [p for p in model.parameters() if p.requires_grad]
        self.engine = deepspeed.initialize(model=model, model_parameters=params, config=ds_cfg)[0]
        self.engine.train()
        self.ref = (
            reference_engine(self.cand, path, ds_cfg, spec.qlora_quant_type, spec.mlp_tile_tokens) if with_ref else None
        )
        del hf_ds
        self.spec = spec
        self.restore = None
        # search.kernels: Liger's kernels patched in as training patches them (run_parts.step_runner)
        if cand.kernels == "liger":
            from memfit.train import liger

            self.restore = liger.snapshot(self.engine.module)  # put back at `close` for the engines after it
            liger.apply(self.engine.module)

    def runner(self, method: str, c: Candidate) -> StepRunner:
        return StepRunner(
            method,
            self.engine,
            self.ref if (method in REFERENCE_METHODS and c.ref == "model") else None,
            0,
            dpo=self.spec.dpo if method == "dpo" else None,
            pref=self.spec.pref.get(method),
            ref=c.ref,
            loss_on=self.spec.loss_on,
            loss_impl="liger" if c.kernels == "liger" else c.loss_impl,  # Liger's fused linear cross-entropy
            loss_chunk_tokens=self.spec.loss_chunk_tokens,
            # search.padding_free: its own batch shape (space.compute_key), one row of every sequence
            padding_free=c.padding_free,
        )

    def micro(self, method: str, c: Candidate, step: bool) -> float:
        """Seconds of one micro step: forward + loss + backward (+ `engine.step()`, which acts
        only at the accumulation boundary)."""
        runner, rows = self.runner(method, c), _rows(method, c, self.vocab)
        _sync()
        t0 = time.perf_counter()
        with long_context.activation_offload(c):
            loss, _, _ = runner.loss(rows, pad_to=c.seq_len)
            self.engine.backward(loss)
        if step:
            self.engine.step()
        _sync()
        return time.perf_counter() - t0

    def optimizer_steps(self, method: str, c: Candidate, n: int) -> list[tuple[float, float]]:
        """`n` optimizer steps of two micro steps: (plain micro step, boundary micro step) seconds each."""
        return [(self.micro(method, c, True), self.micro(method, c, True)) for _ in range(n)]

    def ref_forward(self, c: Candidate) -> float:
        """Seconds of the reference's forward on a DPO micro batch of `c` (no gradients)."""
        runner = self.runner("dpo", c)
        rows = _rows("dpo", c, self.vocab)
        from memfit.train.batches import collate

        batch = {k: v.to(dist_env.device()) for k, v in collate("dpo", rows, 0, c.seq_len).items()}
        _sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            runner.token_logps(
                self.ref, batch["labels"], input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            )
        _sync()
        return time.perf_counter() - t0

    def close(self) -> None:
        from memfit.train.reference import _forget_zero3_module

        for e in (self.engine, self.ref):
            if e is not None:
                _forget_zero3_module(e.module)
                e.destroy()
        self.engine = self.ref = None
        if self.restore is not None:
            self.restore()
        import gc

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


SCORE_ENGINE = "score|"  # the prefix of a reward model's compute engine in the plan


def plan(candidates: dict[str, list[Candidate]]) -> dict[str, Any]:
    """What to measure: the ZeRO-0 compute engines with their (method, candidate) shapes, the
    other engines with the smallest SFT-or-DPO shape of theirs (`shape0`), and which need a
    reference engine."""
    compute: dict[str, dict[str, Any]] = {}
    runtime: dict[str, dict[str, Any]] = {}
    for method, cands in sorted(candidates.items()):
        for c in cands:
            if c.sequence_parallel > 1:  # not calibrated: the estimator prices it (timing.missing says why)
                continue
            base = compute_engine(c)
            if method == "rm":  # a reward model: its own compute engines; the DeepSpeed runtime its LM twin's
                key = f"{SCORE_ENGINE}{engine_key(base)}"
                e = compute.setdefault(key, {"cand": base, "shapes": {}, "ref": False, "score": True})
                e["shapes"].setdefault(compute_key(method, c), (method, c))
                continue
            e = compute.setdefault(engine_key(base), {"cand": base, "shapes": {}, "ref": False})
            e["shapes"].setdefault(compute_key(method, c), (method, c))
            e["ref"] |= method in REFERENCE_METHODS and c.ref == "model"
            if engine_key(c) != engine_key(base):
                r = runtime.setdefault(engine_key(c), {"cand": c, "ref": False})
                r["ref"] |= method in REFERENCE_METHODS and c.ref == "model" and c.zero == 3
    for e in compute.values():  # every engine's overhead is measured at the smallest shape of its compute twin
        e["shape0"] = min(e["shapes"].values(), key=lambda mc: (mc[0] != "sft", mc[1].micro_batch, mc[1].seq_len))
    return {"compute": compute, "runtime": runtime}


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _measure_layers(spec: Spec, layers: int, p: dict[str, Any], log) -> dict[str, dict[str, float]]:
    """Every figure for one layer count: {"compute": {key: s}, "runtime": {key: {micro, boundary, ref}}}."""
    path = _layer_model(spec, layers)
    out: dict[str, dict[str, Any]] = {"compute": {}, "runtime": {}, "ref0": {}}
    for key, e in sorted(p["compute"].items()):
        t0 = time.perf_counter()
        eng = _Engine(spec, path, e["cand"], with_ref=e["ref"], score=e.get("score", False))
        method0, c0 = e["shape0"]
        eng.optimizer_steps(method0, c0, WARMUP_STEPS)
        for ck, (method, c) in sorted(e["shapes"].items()):
            # no warm-up per shape: the engine is warm, and the median drops a first slow sample
            out["compute"][ck] = _median([eng.micro(method, c, step=False) for _ in range(spec.reps)])
        eng.engine.zero_grad()
        if e.get("score"):  # the reward model's compute only: its engine's runtime is the LM twin's
            eng.close()
            log(
                f"{layers} layer(s): reward-model engine {key}: {len(e['shapes'])} shapes in {time.perf_counter() - t0:.1f} s"
            )
            continue
        steps = eng.optimizer_steps(method0, c0, spec.reps)
        out["runtime"][key] = {"micro": 0.0, "boundary": _median([b - a for a, b in steps])}
        if e["ref"]:
            out["ref0"][key] = _median([eng.ref_forward(c0) for _ in range(spec.reps)])
        eng.close()
        log(f"{layers} layer(s): ZeRO-0 engine {key}: {len(e['shapes'])} shapes in {time.perf_counter() - t0:.1f} s")
    for key, r in sorted(p["runtime"].items()):
        t0 = time.perf_counter()
        base = p["compute"][engine_key(compute_engine(r["cand"]))]
        method0, c0 = base["shape0"]
        c0 = dataclasses.replace(c0, **{k: getattr(r["cand"], k) for k in UNPARTITIONED})
        eng = _Engine(spec, path, r["cand"], with_ref=r["ref"])
        eng.optimizer_steps(method0, c0, WARMUP_STEPS)
        steps = eng.optimizer_steps(method0, c0, spec.reps)
        plain = _median([a for a, _ in steps])
        fig = {
            "micro": plain - out["compute"][compute_key(method0, c0)],
            "boundary": _median([b - a for a, b in steps]),
        }
        if r["ref"]:
            fig["ref"] = (
                _median([eng.ref_forward(c0) for _ in range(spec.reps)])
                - out["ref0"][engine_key(compute_engine(r["cand"]))]
            )
        out["runtime"][key] = fig
        eng.close()
        log(f"{layers} layer(s): engine {key} in {time.perf_counter() - t0:.1f} s")
    return out


def depths(num_layers: int, seconds_at_n: float | None = None, memory_at_n: float = 0.0) -> list[int]:
    """1 and n = min(num_layers, MAX_LAYERS), and num_layers too where the n-layer pass (`seconds_at_n`, `memory_at_n`
    its peak share of the device, the slowest rank's) scaled by num_layers / n is within WHOLE_MODEL_S and _MEMORY.
    A model of at most MAX_LAYERS layers is measured whole and only so: its figures price its own depth
    exactly, and no other (timing.refusal), and the 1-layer pass was a fifth of the CPU demo's calibration."""
    if num_layers <= MAX_LAYERS:
        return [num_layers]
    n = MAX_LAYERS
    k = num_layers / n
    cheap = seconds_at_n is not None and seconds_at_n * k <= WHOLE_MODEL_S and memory_at_n * k <= WHOLE_MODEL_MEMORY
    return sorted({1, n} | ({num_layers} if k > 1 and cheap else set()))


def _measure_depths(spec: Spec, p: dict[str, Any], log) -> tuple[list[int], dict[str, Any]]:
    """The figures at every depth `depths` names; every rank decides on the slowest rank's n-layer pass."""
    depth, per_layers, cuda = _num_layers(spec.model_path), {}, torch.cuda.is_available()
    for n in depths(depth):
        if cuda:  # the peak of the last pass, the n-layer one
            torch.cuda.reset_peak_memory_stats()
        t1 = time.perf_counter()
        per_layers[str(n)] = _measure_layers(spec, n, p, log)
    mem = torch.cuda.max_memory_allocated() / torch.cuda.mem_get_info()[1] if cuda else 0.0
    layers = depths(depth, *dist_env.all_reduce_max([time.perf_counter() - t1, mem]))
    if depth in layers and str(depth) not in per_layers:
        log(f"the model whole ({depth} layers): projected within {WHOLE_MODEL_S:.0f} s")
        per_layers[str(depth)] = _measure_layers(spec, depth, p, log)
    return layers, per_layers


def calibrate(spec: Spec, log=print) -> dict[str, Any] | None:
    """Measure everything `spec` needs on this rank; the figures (max over ranks) on rank 0, None elsewhere."""
    cands = {m: [Candidate.from_dict(c) for c in cs] for m, cs in spec.candidates.items()}
    p = plan(cands)
    tracker = None if torch.cuda.is_available() else AllocationTracker(dist_env.device())
    if tracker is not None:
        tracker.__enter__()
    t0 = time.perf_counter()
    try:
        layers, per_layers = _measure_depths(spec, p, log)
    finally:
        if tracker is not None:
            tracker.__exit__(None, None, None)
    # the slowest rank's figure: one all-reduce over every number, in a fixed order
    flat = [
        (n, part, k, f)
        for n, d in per_layers.items()
        for part in ("compute", "runtime")
        for k, f in sorted(d[part].items())
    ]
    values: list[float] = []
    for _, part, _, f in flat:
        values += [f] if part == "compute" else [f[x] for x in sorted(f)]
    adam = None
    if wants_cpu_adam(cands):  # every rank at once, outside the tracker: the op is one call a step
        dist_env.barrier()
        values.append(cpu_adam_seconds(CPU_ADAM_BLOCK, spec.reps))
        log(f"DeepSpeedCPUAdam: {CPU_ADAM_BLOCK:,} parameters in {values[-1]:.4f} s on rank 0")
    values = dist_env.all_reduce_max(values)
    if wants_cpu_adam(cands):
        seconds = values.pop()
        adam = cpu_adam_figure(seconds)
    result: dict[str, Any] = {"compute": {}, "runtime": {}}
    i = 0
    for n, part, k, f in flat:
        if part == "compute":
            result["compute"].setdefault(k, {})[n] = values[i]
            i += 1
        else:
            fig = result["runtime"].setdefault(k, {})
            for x in sorted(f):
                fig.setdefault(x, {})[n] = values[i]
                i += 1
    if dist_env.rank() != 0:
        return None
    import deepspeed

    return {
        "format": FORMAT,
        "measured_on": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"cpu ({platform.processor() or platform.machine()})",
        # the device as torch names it and its memory (memfit.train.device_info): the estimator
        # matches them to the GPU it prices (memfit.estimate.time.device_match) and refuses another (#41)
        **device_identity(dist_env.device()),
        "model": spec.model or None,
        "host": platform.node(),
        "world_size": dist_env.world(),
        "threads_per_rank": torch.get_num_threads(),
        "backend": dist_env.backend(),
        "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__},
        "layers": layers,
        "reps": spec.reps,
        "seconds": round(time.perf_counter() - t0, 1),
        "compute": result["compute"],
        "runtime": result["runtime"],
        **({"cpu_adam": adam} if adam else {}),
    }


def main(argv: list[str] | None = None) -> int:
    import warnings

    from memfit.train.startup import defer_torch_compile, memoize_cpu_info

    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    ap = argparse.ArgumentParser(
        prog="memfit calibrate", description="Run one calibration rank (see memfit.train.calibrate)."
    )
    ap.add_argument("--spec", required=True, help="calibration spec JSON (memfit.train.calibrate.Spec fields)")
    args = ap.parse_args(argv)
    spec = Spec.load(args.spec)
    memoize_cpu_info()
    defer_torch_compile()
    if spec.deterministic:  # before the process group, as a training rank does
        determinism.enable()
    dist_env.init_distributed()
    rank = dist_env.rank()
    result = calibrate(spec, log=lambda m: print(m, flush=True) if rank == 0 else None)
    if result is not None:
        write_json_atomic(Path(spec.out), result)
    dist_env.finish()
    return 0
