"""DeepSpeed SFT and DPO training, one rank per process; probes run the same step.

Launch all ranks of a run on one node (what the `train` and `probe_candidate` rules do):

    memfit launch --config results/demo-tiny/cpu/sft/run.json --nproc 2

which starts `python -m memfit.cli train --config ...` once per rank (memfit.train.rank.main;
memfit.train.local_ranks sets what torchrun would: RANK, WORLD_SIZE, MASTER_PORT, ...). On a GPU node `--nproc` is the number
of GPUs; under SLURM the same entry point runs once per task.

The loop reads top to bottom: strategy -> model -> reference -> data -> DeepSpeed ->
resume -> fit -> export (OpenRLHF's `train()` order). What it is asked to do is
memfit.train.run_config.RunConfig; its checkpoint hooks (which checkpoint to resume, loading, saving)
are memfit.train.resume.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit.atomic import write_json_atomic
from memfit.data import load_split, worst_case_batch
from memfit.train import checkpoint, dsconfig, liger, long_context, sequence_parallel
from memfit.train import dist as dist_env
from memfit.train import resume as train_resume
from memfit.train.batches import Schedule, probe_rows, rank_batches
from memfit.train.compile import compiled_graphs
from memfit.train.device_info import device_identity
from memfit.train.memory import AllocationTracker, device_peaks, reset_device_peaks
from memfit.train.modeling import check_hardware, export_model, hidden_size, load_model, model_dir
from memfit.train.preference import finish_metrics
from memfit.train.reference import precompute_reference
from memfit.train.run_config import PREEMPTED_EXIT_CODE, PREEMPTED_MARKER, REFERENCE_METHODS, RunConfig
from memfit.train.run_parts import StepTime, check_data, frozen_reference, steady_step_times, step_runner
from memfit.units import MIB

_STOP_REQUESTED = threading.Event()


def request_stop(signum, _frame) -> None:
    _STOP_REQUESTED.set()


# --------------------------------------------------------------------------- the run
class Run:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.cand = cfg.cand
        self._probe_units: list[Any] | None = None  # the probe's worst-case micro batch, made once
        self.rank, self.world = dist_env.rank(), dist_env.world()
        # a sequence-parallel group (consecutive ranks, deepspeed parallel_state_sp) shares each batch
        self.dp_rank, self.dp_world = self.rank // self.cand.sequence_parallel, self.cand.data_parallel(self.world)
        self._offload_said = False  # the activation offload's counters are logged once
        self.out = Path(cfg.out_dir)
        self.ckpt_root = self.out / "checkpoints"
        self.metrics_path = self.out / "metrics.jsonl"
        self.tracker: AllocationTracker | None = None  # set by _start_tracking (CPU only)
        self.oom_phase = "setup"  # what the run does now; recorded with an OOM
        self.step_now = 0  # the training step running (or last finished): the OOM marker's step

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, file=sys.stderr, flush=True)

    def setup(self) -> None:
        import deepspeed
        from transformers import AutoTokenizer

        cfg, cand = self.cfg, self.cand
        check_hardware(cand)
        if cfg.compile:  # no C++ compiler for inductor's CPU backend: refused before anything loads
            from memfit.train.compile import compile_problem
            from memfit.train.run_config import RunRefused

            if why := compile_problem():
                raise RunRefused(why)
        liger.refuse(cfg.kernels, model_dir(cfg.model_path))  # kernels: liger: package, GPU, model type
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

        self.train_rows = load_split(cfg.data_dir, "train")
        self.eval_rows = load_split(cfg.data_dir, "eval")
        check_data(cfg, self.train_rows)  # data prepared for another method: refused here
        # What a step draws: rows, or with packing packed sequences (global_batch counts those).
        self.train_units: list[Any] = self.train_rows
        self.packing: dict[str, Any] | None = None
        if cfg.packing:
            self.train_units, self.packing = self._pack()
        sequence_parallel.check(cand, self.world, cfg.packing)
        self.schedule = Schedule(
            len(self.train_units),
            cand.micro_batch,
            cand.grad_accum,
            self.dp_world,
            cfg.seed,
            unit="packed sequences (train.sft.packing)" if cfg.packing else "training rows",
        )
        # the step count and DeepSpeed config select_config wrote to ds_config.json (dsconfig.planned_steps)
        self.total_steps, _ = dsconfig.schedule_steps(cfg, self.schedule.steps_per_epoch)
        ds_cfg = dsconfig.for_run(cfg, self.world, self.total_steps, hidden_size(model_dir(cfg.model_path)))
        self.ds_config = ds_cfg
        if cfg.method in REFERENCE_METHODS and cand.ref == "precomputed":
            precompute_reference(self, ds_cfg)
        hf_ds = None
        if cand.zero == 3:
            from transformers.integrations import HfDeepSpeedConfig

            # Keeps a global weakref that makes from_pretrained partition weights as it loads
            # (zero.Init): no rank ever holds the whole model. Must stay alive until initialize.
            hf_ds = HfDeepSpeedConfig(ds_cfg)
        # which checkpoint a resume reads, refused here (before any model is loaded) when it is
        # another run's; a universal load is a DeepSpeed config key, so it is decided before initialize
        self.resume_plan = None if cfg.probe_steps else train_resume.plan_resume(self)
        if self.resume_plan and self.resume_plan[2] == checkpoint.UNIVERSAL_LOAD:
            ds_cfg["checkpoint"] = {"load_universal": True}  # config-json.md, "Checkpoint options"
        lora = {"alpha": cfg.lora_alpha, "dropout": cfg.lora_dropout, "targets": cfg.lora_targets}
        score = self.pad_id if cfg.method == "rm" else None  # rm: a sequence-classification model
        model = load_model(cfg.model_path, cand, True, lora, cfg.qlora_quant_type, score)
        if said := long_context.prepare(model, cand, cfg.mlp_tile_tokens):  # the tiled MLP (DeepSpeed ALST)
            self.log(said)
        mpu, shard = sequence_parallel.setup(model, cand, cfg.method)  # Ulysses: the attention and groups
        if cfg.compile:  # regional compile of the decoder layers, before DeepSpeed wraps the model
            from memfit.train.compile import compile_layers

            self.log(compile_layers(model))
        params = [p for p in model.parameters() if p.requires_grad]
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=model, model_parameters=params, config=ds_cfg, mpu=mpu
        )
        # WarmupCosineLR starts at last_batch_iteration=-1, where get_lr_ratio() is 0, and the
        # engine steps it only after each optimizer step (deepspeed/runtime/lr_schedules.py,
        # engine.py _take_model_step): without this step the first step would train at lr 0 and
        # every later one a step behind the schedule. After it, step k uses the schedule's value
        # at k-1, as transformers' get_cosine_schedule_with_warmup does.
        if self.scheduler is not None and self.scheduler.last_batch_iteration < 0:
            self.scheduler.step()

        self.ref_engine = frozen_reference(cfg, cand, ds_cfg)  # DPO and KTO with ref: model
        del hf_ds
        self.runner = step_runner(cfg, cand, self.engine, self.ref_engine, self.pad_id, shard, self.log)
        if cfg.padding_free:
            self.log("padding_free: each micro batch runs as one row of its rows' tokens, positions restarting per row")

    def _pack(self) -> tuple[list[list[dict[str, Any]]], dict[str, Any]]:
        """SFT packing: the training rows in packs of at most seq_len tokens (memfit.data.pack)."""
        from memfit.data import pack

        cap = self.cand.seq_len
        lengths = [len(r["input_ids"]) for r in self.train_rows]
        if max(lengths) > cap:
            raise ValueError(
                f"train.sft.packing: a training row has {max(lengths)} tokens, more than the "
                f"candidate's seq_len {cap} a pack holds; set search.seq_len >= data.max_len (or null)"
            )
        packs = pack(lengths, cap, self.cfg.seed)
        units = [[self.train_rows[i] for i in p] for p in packs]
        stats = {
            "rows": len(lengths),
            "packs": len(packs),
            "capacity": cap,
            "rows_per_pack": round(len(lengths) / len(packs), 3),
            "fill": round(sum(lengths) / (len(packs) * cap), 4),  # real tokens / pack slots
        }
        self.log(
            f"packing: {stats['rows']} rows into {stats['packs']} sequences of <= {cap} tokens "
            f"({stats['rows_per_pack']} rows each, {stats['fill']:.1%} filled)"
        )
        return units, stats

    # -- evaluation ----------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Means over every held-out row; every rank runs the same number of forwards (ZeRO-3)."""
        sums: dict[str, float] = {}
        count = 0.0
        self._phase("evaluation")
        self.engine.eval()
        with torch.no_grad():
            for idx, batch in rank_batches(self.eval_rows, self.cand.micro_batch, self.dp_world, self.dp_rank):
                real = len(idx)
                loss, m, _ = self.runner.loss(batch)
                # a dummy batch (real == 0) adds zeros under the same keys: every rank then reduces
                # the same list (gloo: "collective mismatch" when a rank had no real eval rows)
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + (v if real else 0.0)
                count += real
        self.engine.train()
        keys = sorted(sums) if sums else ["loss"]  # no batch on any rank: rank_batches yields alike
        totals = dist_env.all_reduce_sum([sums.get(k, 0.0) for k in keys] + [count])
        n = max(totals[-1], 1.0)
        return finish_metrics(self.cfg.method, {k: totals[i] / n for i, k in enumerate(keys)})

    # -- one optimizer step --------------------------------------------------
    def train_step(self, step: int, probe_rows: list[dict[str, Any]] | None) -> dict[str, float]:
        t0 = time.perf_counter()
        sums: dict[str, float] = {}
        rows_seen = 0
        tokens = 0
        for idx in self.schedule.micro_batches(step, self.dp_rank):
            rows = probe_rows if probe_rows is not None else [self.train_units[i] for i in idx]
            pad_to = self.cand.seq_len if probe_rows is not None else None
            offload = long_context.activation_offload(self.cand)
            with offload:  # the micro step's forward and backward
                self._phase("forward")
                loss, m, tok = self.runner.loss(rows, pad_to=pad_to, packed=self.cfg.packing)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"non-finite loss {float(loss)} at step {step + 1} on rank {self.rank}")
                self._phase("backward")
                self.engine.backward(loss)
            if self.cand.activation_offload and not self._offload_said:
                self._offload_said = True
                self.log(long_context.offload_summary(offload))
            self._phase("optimizer step")
            self.engine.step()
            self._phase("between steps")
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v
            rows_seen += len(rows)
            tokens += tok
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        keys = sorted(sums)
        totals = dist_env.all_reduce_sum([sums[k] for k in keys] + [rows_seen])
        out = finish_metrics(self.cfg.method, {k: totals[i] / totals[-1] for i, k in enumerate(keys)})
        out["tokens_per_s"] = tokens / dt  # non-padding tokens per second, this rank
        out["step_time_s"] = dt
        return out

    def _phase(self, name: str) -> None:
        """What the step does now, for the cpu capacity's OOM record (memfit.train.rank.run_rank's
        marker) and for `peak_phase`: the phase that ends is the one the peak was reached in when
        the peak grew during it (the allocator's or the tracker's peak counter, read without a
        reset, so the overall peak stays what it was)."""
        tracked = getattr(self, "_peak_seen", None)
        if tracked is not None and self.oom_phase:
            peak = device_peaks(getattr(self, "tracker", None)).allocated
            if peak > tracked:
                self._peak_seen, self.peak_phase = peak, self.oom_phase
        self.oom_phase = name
        if getattr(self, "tracker", None) is not None:
            self.tracker.phase = name

    # -- the loop -------------------------------------------------------------
    def _stop_signal_received(self) -> bool:
        """True on every rank once any rank got SIGTERM/SIGUSR1 (one all-reduce per step)."""
        return bool(dist_env.all_reduce_max([float(_STOP_REQUESTED.is_set())])[0])

    def _start_tracking(self):
        """Peak memory from here on: an AllocationTracker on the CPU (None on CUDA, where the
        allocator's own peak counters are read), with the device peaks reset."""
        # from_pretrained returns the model in eval mode (transformers modeling_utils.py), and
        # transformers checkpoints a layer only when `self.gradient_checkpointing and
        # self.training` (modeling_layers.py GradientCheckpointingLayer), LoRA dropout likewise:
        # without this, probes and any run before its first evaluation trained in eval mode.
        self.engine.train()
        tracker = (
            None
            if torch.cuda.is_available()
            else AllocationTracker(dist_env.device(), capacity_bytes=self.cfg.device_capacity_bytes)
        )
        self.tracker = tracker
        reset_device_peaks()
        if tracker is not None:
            tracker.__enter__()
        self._peak_seen, self.peak_phase = 0, None
        return tracker

    def _progress(self, initial: int, desc: str):
        from tqdm import tqdm

        return tqdm(
            total=self.total_steps, initial=initial, desc=desc, disable=self.rank != 0, file=sys.stderr, mininterval=2.0
        )

    def _step_row(
        self,
        step: int,
        tracker,
        peaks: list[tuple[int, int | None]],
        step_times: list[float],
        probe_rows: list[Any] | None = None,
    ) -> dict[str, Any]:
        """Run training step `step` and return its metrics row (peaks over all ranks)."""
        # what this step uses: the optimizer's own value (DeepSpeed's WarmupCosineLR.load_state_dict
        # restores the iteration but not get_last_lr(), which read 0.0 on the first resumed step)
        lr = float(self.engine.get_lr()[0])
        m = self.train_step(step, probe_rows)
        pk = device_peaks(tracker)
        peaks.append((pk.allocated, pk.reserved))
        step_times.append(StepTime(m["step_time_s"], compiled_graphs() if self.cfg.compile else 0))
        alloc, reserved, rss = dist_env.all_reduce_max([pk.allocated, pk.reserved or 0, pk.host_rss])
        return {
            "step": step + 1,
            "split": "train",
            **m,
            "lr": lr,
            "grad_norm": _float_or_none(self.engine.get_global_grad_norm()),
            "peak_allocated_bytes": int(alloc),
            "peak_reserved_bytes": int(reserved) if pk.reserved is not None else None,
            "host_rss_bytes": int(rss),
            # compile: graphs dynamo compiled so far (the same from the second step on: no recompile)
            **({"compiled_graphs": compiled_graphs()} if self.cfg.compile else {}),
        }

    def probe(self) -> dict[str, Any]:
        """Probe mode: `probe_steps` steps on the worst-case micro batch (`_worst_case_units`: at
        seq_len), no resume, evaluation, metrics file or checkpoints; step times and peaks."""
        tracker = self._start_tracking()
        self.resume_peak: dict[str, int] | None = None
        probe_rows = self._worst_case_units()
        step_times: list[float] = []
        peaks: list[tuple[int, int | None]] = []
        bar = self._progress(0, f"{self.cfg.method} probe")
        try:
            for step in range(self.total_steps):
                self._step_row(step, tracker, peaks, step_times, probe_rows)
                bar.update(1)
                if self.cfg.stop_after_step is not None and step + 1 >= self.cfg.stop_after_step:
                    self.log(f"stopping after step {step + 1} (stop_after_step)")
                    return {"stopped_at": step + 1}
        finally:
            bar.close()
            if tracker is not None:
                tracker.__exit__(None, None, None)
        return self._summary(step_times, peaks)

    def fit(self) -> dict[str, Any]:
        """Train: resume -> (eval) -> steps with logging, evaluation and checkpoints -> export."""
        cfg = self.cfg
        self.log(cfg.describe_lr())  # the number trained with, and whether it is memfit's default
        tracker = self._start_tracking()
        if self.rank == 0:
            (self.out / PREEMPTED_MARKER).unlink(missing_ok=True)
        start_step = self._resume(tracker)
        self.step_now = start_step
        step_times: list[float] = []
        peaks: list[tuple[int, int | None]] = []
        bar = self._progress(start_step, cfg.method)
        try:
            if start_step == 0 and self.eval_rows:
                self._write_metrics({"step": 0, "split": "eval", **self.evaluate()})
            for step in range(start_step, self.total_steps):
                self.step_now = step + 1
                row = self._step_row(step, tracker, peaks, step_times)
                if start_step and step == start_step:
                    row["resumed_from_step"] = start_step  # the report marks each resume on the curves
                done = row["step"]
                self._after_step(row)
                bar.update(1)
                if self._stop_signal_received():
                    self._preempt(done)
                if cfg.stop_after_step is not None and done >= cfg.stop_after_step:
                    self.log(f"stopping after step {done} (stop_after_step)")
                    return {"stopped_at": done}
        finally:
            bar.close()
            if tracker is not None:
                tracker.__exit__(None, None, None)
        summary = self._summary(step_times, peaks)
        if cfg.export:
            self.export()
        return summary

    def _resume(self, tracker) -> int:
        """Resume if a checkpoint says so; what loading it cost is kept apart from the training peak."""
        self.resume_peak = None
        self._phase("checkpoint load")
        start_step = self.maybe_resume()
        self._phase("between steps")
        if start_step:
            pk = device_peaks(tracker)
            alloc, reserved, rss = dist_env.all_reduce_max([pk.allocated, pk.reserved or 0, pk.host_rss])
            self.resume_peak = {"allocated": int(alloc), "reserved": int(reserved), "host_rss": int(rss)}
            if tracker is not None:
                tracker.reset_peak()
            reset_device_peaks()
        return start_step

    def _after_step(self, row: dict[str, Any]) -> None:
        """Metrics row, log line, evaluation and checkpoint after a training step."""
        cfg, done = self.cfg, row["step"]
        self._write_metrics(row)
        if done % cfg.log_every == 0 or done == self.total_steps:
            self.log(_log_line(row))
        if cfg.eval_every and (done % cfg.eval_every == 0 or done == self.total_steps) and self.eval_rows:
            ev = self.evaluate()
            self._write_metrics({"step": done, "split": "eval", **ev})
            self.log(f"step {done}: eval " + ", ".join(f"{k} {v:.4f}" for k, v in ev.items()))
        if cfg.save_every and (done % cfg.save_every == 0 or done == self.total_steps):
            self.save(done)

    def _preempt(self, done: int) -> None:
        """SLURM sends SIGTERM (or --signal=USR1@secs) before the wall-time kill: checkpoint
        now, exit non-zero, and the re-run resumes from here."""
        if not (self.cfg.save_every and done % self.cfg.save_every == 0):
            self.save(done)
        self.log(f"signal received: checkpointed step {done}; exiting to be resumed")
        if self.rank == 0:
            write_json_atomic(self.out / PREEMPTED_MARKER, {"step": done})
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def _summary(self, step_times: list[float], peaks: list[tuple[int, int | None]]) -> dict[str, Any]:
        self._phase(self.oom_phase)  # the phase the last step ended in counts too
        alloc = max((p[0] for p in peaks), default=0)
        reserved = max((p[1] or 0 for p in peaks), default=0)
        rss = device_peaks(None).host_rss
        mx = dist_env.all_reduce_max([alloc, reserved, rss])
        host_sum = dist_env.all_reduce_sum([rss])[0]
        steady = steady_step_times(step_times)
        return {
            "world_size": self.world,
            "steps": len(step_times),
            "peak_allocated_bytes": int(mx[0]),
            "peak_reserved_bytes": int(mx[1]) if torch.cuda.is_available() else None,
            "host_rss_bytes_max_rank": int(mx[2]),
            "host_rss_bytes_node": int(host_sum),
            "first_step_time_s": step_times[0] if step_times else None,
            "step_time_s": statistics.median(steady) if steady else None,
            "device": str(dist_env.device()),
            **device_identity(dist_env.device()),  # the selection refuses another device's figures
            # a probe's steps after its warm-up: the spread the selection weighs (memfit.estimate.selection)
            **({"steady_step_times_s": [round(t, 6) for t in steady]} if self.cfg.probe_steps else {}),
            "memory_source": "torch.cuda.max_memory_allocated"
            if torch.cuda.is_available()
            else "AllocationTracker (live tensor storages)",
            # where rank 0's peak was reached: forward, backward, optimizer step (engine.step) ...
            "peak_phase": getattr(self, "peak_phase", None),
            # loading a checkpoint (resumed runs only): device peak while DeepSpeed loaded the shards
            # and host RSS (the process's peak so far) right after; training peaks exclude it
            "resume_peak_allocated_bytes": self.resume_peak["allocated"] if self.resume_peak else None,
            "resume_peak_reserved_bytes": (self.resume_peak["reserved"] or None) if self.resume_peak else None,
            "resume_host_rss_bytes": self.resume_peak["host_rss"] if self.resume_peak else None,
            "packing": self.packing,  # SFT packing: rows, packs, capacity, rows_per_pack, fill; else None
            **({"compiled_graphs": compiled_graphs()} if self.cfg.compile else {}),
        }

    def _worst_case_units(self) -> list[Any]:
        """The probe's micro batch: the longest rows, or with packing the fullest packs, each
        padded to seq_len by the caller, so the probe runs the largest shape training can meet
        through the same (packed or padded) code path; a forward of one sequence is filled with
        its own tokens instead, unpadded as in training (`batches.probe_rows`)."""
        if self._probe_units is None:
            if not self.cfg.packing:
                rows = worst_case_batch(self.cfg.data_dir, self.cand.micro_batch)
                self._probe_units = probe_rows(self.cfg.method, rows, self.cand.seq_len)
            else:
                size = [sum(len(r["input_ids"]) for r in p) for p in self.train_units]
                fullest = sorted(range(len(size)), key=lambda i: (-size[i], i))[: self.cand.micro_batch]
                self._probe_units = [self.train_units[fullest[k % len(fullest)]] for k in range(self.cand.micro_batch)]
        return self._probe_units

    # -- metrics, checkpoints, export ---------------------------------------
    def _write_metrics(self, row: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def save(self, step: int) -> None:
        train_resume.save(self, step)

    def maybe_resume(self) -> int:
        return train_resume.load_planned(self)

    def export(self) -> None:
        """Final model in HF format (safetensors) in out_dir/model (memfit.train.modeling.export_model)."""
        export_model(
            self.engine, self.tokenizer, self.out, self.cand, self.rank, self.cfg.export_format, self.cfg.model_path
        )


def _float_or_none(x: Any) -> float | None:
    if x is None:
        return None
    return float(x.item() if hasattr(x, "item") else x)


def _log_line(row: dict[str, Any]) -> str:
    parts = [f"step {row['step']}: loss {row['loss']:.4f}"]
    if "rewards/accuracies" in row:
        parts.append(f"acc {row['rewards/accuracies']:.2f}, margin {row['rewards/margins']:.3f}")
    parts.append(f"{row['tokens_per_s'] / 1e3:.1f}k tok/s")
    parts.append(f"lr {row['lr']:.2e}")
    parts.append(f"peak {row['peak_allocated_bytes'] / MIB:.1f} MiB")
    return ", ".join(parts)
