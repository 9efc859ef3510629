"""What a configuration really uses: a few real training steps on the worst-case batch.

A probe runs the training step of `memfit.train.loop` (same model, same DeepSpeed config,
same loss) for `steps` optimizer steps on the longest rows of the data, padded to the
candidate's `seq_len`, on every rank, and records peak allocated/reserved memory,
host RSS and step time. Running out of memory is a result, not a crash: the probe
writes `"status": "oom"` and the workflow goes on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from memfit.atomic import write_json_atomic
from memfit.train.device_info import device_identity
from memfit.train.launch import launch
from memfit.train.run_config import OOM_EXIT_CODE, RunConfig


def run_probe(
    run: RunConfig,
    nproc: int,
    out_json: Path,
    log: Path | None = None,
    steps: int = 3,
    timeout_s: float = 900,
    prediction: dict[str, Any] | None = None,
    nnodes: int = 1,
) -> dict[str, Any]:
    """Probe `run.candidate`; write and return the result (status ok | oom | error | timeout)."""
    out_json = Path(out_json)
    work = Path(tempfile.mkdtemp(prefix="probe-", dir=out_json.parent if out_json.parent.exists() else None))
    try:
        cfg = dataclasses.replace(run, out_dir=str(work), probe_steps=steps, export=False, resume="never", save_every=0)
        cfg_path = work / "run.json"
        cfg.save(cfg_path)
        result: dict[str, Any] = {"id": cfg.cand.id, "candidate": cfg.candidate, "world_size": nproc, "steps": steps}
        try:
            rc = launch(cfg_path, nproc, log=log, timeout_s=timeout_s, nnodes=nnodes)
        except subprocess.TimeoutExpired:
            rc = None
        ooms = sorted(work.glob("oom.rank*.json"))
        if rc == 0:
            result |= json.loads((work / "probe.rank0.json").read_text()) | {"status": "ok"}
        elif rc is None:
            result |= {"status": "timeout", "error": f"probe did not finish within {timeout_s:.0f} s"}
        elif ooms or rc in (OOM_EXIT_CODE, -signal.SIGKILL, 128 + signal.SIGKILL):
            # A CUDA OOM writes a marker; a host OOM is the kernel's SIGKILL.
            marker = json.loads(ooms[0].read_text()) if ooms else {}
            detail = marker.get("error") or f"killed (exit {rc}): host out of memory?"
            # phase (forward | backward | optimizer step | ...), live and capacity bytes at the OOM
            where = {k: marker[k] for k in ("phase", "op", "live_bytes", "capacity_bytes") if k in marker}
            result |= {"status": "oom", "error": detail, "oom": where or None}
        else:
            result |= {"status": "error", "error": f"exit code {rc}; see {log}", "log_tail": _tail(log)}
        if result["status"] != "ok":  # no rank summary (OOM, timeout): where the launcher ran the ranks
            result |= device_identity()
        if prediction is not None:
            result["predicted"] = {
                k: prediction.get(k)
                for k in ("peak_allocated_bytes", "peak_reserved_bytes", "host_bytes", "step_time_s")
            }
            if prediction.get("step_time_worst_case_s") is not None:
                # priced on the data (padding_free, or padded with the data's lengths): the probe runs the
                # worst case (every sequence seq_len tokens), which the estimate priced before scaling
                # it to the data's rows (memfit.estimate.time.data_scale)
                result["predicted"]["step_time_s"] = prediction["step_time_worst_case_s"]
        write_json_atomic(out_json, result)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


class NoTargetDevice(RuntimeError):
    """The config names a GPU this machine does not have, and it is not a plan: probes and the
    calibration would measure the CPU (the launcher runs DeepSpeed there without CUDA) and the
    selection would take that for the GPU. Raised before any rank starts."""


def require_target_device(gpu: str, plan_only: bool, stage: str) -> None:
    """Stop `stage` (calibrate, probe_candidate) before it measures anything when the config's
    `gpus` entry `gpu` is a GPU, CUDA sees none here and `plan_only` is off. Checked in the rule
    that measures, not when the config is read: under `--profile slurm` the DAG is built on a
    login node without GPUs, and only the job on a GPU node measures."""
    if gpu == "cpu" or plan_only:
        return
    import torch

    if torch.cuda.is_available():
        _require_gpu_kind(gpu, stage)
        return
    hidden = " (CUDA_VISIBLE_DEVICES is empty)" if os.environ.get("CUDA_VISIBLE_DEVICES") == "" else ""
    raise NoTargetDevice(
        f"gpus: [{gpu}] asks for a GPU, but this machine has none that CUDA can use{hidden}, and plan_only is "
        f"off: {stage} would measure the CPU and record it as {gpu}. Run it where the {gpu} is (a GPU node; "
        "`gpus: [detect]` names the GPU a machine has), or set `plan_only: true` to estimate and select "
        "without measuring, or `gpus: [cpu]` to run on this machine's CPU."
    )


def _require_gpu_kind(gpu: str, stage: str) -> None:
    """A GPU of another kind than the configured one (nvidia-smi's answer, no CUDA context in this
    process): stop before measuring it. Where nvidia-smi cannot tell, the selection still refuses
    a probe of another device (memfit.estimate.selection.check_probe_devices)."""
    from memfit.estimate.models import detect
    from memfit.estimate.time import device_match

    try:
        devices = detect.smi_devices()
    except (detect.DetectError, OSError, subprocess.SubprocessError):
        return
    if not devices or device_match.mismatch(devices[0][0], devices[0][1] * 2**20, gpu) is None:
        return
    name, mib = devices[0]
    try:
        kind = device_match.catalog_name(name, mib * 2**20)
    except detect.DetectError:
        kind = "not in config/gpus.yaml"
    raise NoTargetDevice(
        f"gpus: [{gpu}] names a GPU this machine does not have: its GPU is {name} ({kind}, {mib} MiB), "
        f"and {stage} would measure it and record it as {gpu}. Run it where the {gpu} is, or name this "
        "GPU in `gpus:` (`gpus: [detect]` does), or set `plan_only: true` to estimate and select without measuring."
    )


class ProbeFailed(RuntimeError):
    """A probe ended for a reason other than running out of memory or time: a bug, a broken
    model or data directory, a missing package. Not a measurement: the workflow stops on it."""


def error_excerpt(log: Path | None, n: int = 25) -> str:
    """The first error in a probe's log: its first Python traceback (the first rank's, up to its
    exception line), else the first line that names an error, with what follows; at most `n` lines.
    The ranks' tracebacks come before anything the launcher adds, so the first is the cause."""
    if log is None or not Path(log).exists():
        return ""
    lines = Path(log).read_text(errors="replace").splitlines()
    # the log is appended to: read from this run's launch command (`memfit.train.launch` writes "$ cmd")
    launched = [i for i, line in enumerate(lines) if line.startswith("$ ")]
    lines = lines[launched[-1] + 1 :] if launched else lines
    start = next((i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line), None)
    if start is None:
        start = next((i for i, line in enumerate(lines) if "error" in line.lower()), max(0, len(lines) - n))
        return "\n".join(lines[start : start + n])
    # A traceback ends at its first unindented line after the header (the exception). Ranks
    # write at once: with torch.distributed's "[rank0]: " prefix (its excepthook), only that rank's
    # lines are followed. A rank that fails before that hook is installed writes no prefix: the
    # other ranks' headers are passed over (their frames may interleave, the exception line is
    # still the first unindented one).
    prefix = lines[start][: lines[start].index("Traceback")]
    block = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith(prefix) or line[len(prefix) :].startswith("Traceback (most recent call last)"):
            continue
        block.append(line)
        if not line[len(prefix) :].startswith((" ", "\t")):
            break
    if len(block) > n:  # keep the head (where it entered) and the tail (where it failed)
        block = block[:3] + ["  ..."] + block[-(n - 4) :]
    return "\n".join(block)


def _tail(log: Path | None, n: int = 40) -> str:
    if log is None or not Path(log).exists():
        return ""
    return "\n".join(Path(log).read_text(errors="replace").splitlines()[-n:])
