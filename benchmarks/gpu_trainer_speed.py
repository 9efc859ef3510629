"""gpu_evidence.py's trainer_speed stage: benchmarks/bench_trainer_speed.py at the Llama-3.1-8B shape on
this GPU (issue #45), memfit against TRL and each with Liger's kernels, SFT, in about 4 minutes.

Two runs of the benchmark, each its own process (a run cut off by the deadline loses only itself):
- lora: all 32 layers, LoRA r=8 on every linear layer, one row of 4,096 tokens a step (the issue's bar:
  >= 10,000 tokens/s and at least TRL+Liger's speed on the same machine);
- full: full fine-tuning of an 8-layer slice (the embeddings, head and 8 of the 32 layers, 2.8e9
  weights: 21 GiB of bf16 weights, gradients and AdamW states), the same rows (the bar: >= 35% MFU).
Variants: trl, trl+liger, memfit, memfit+liger (a Liger variant is recorded skipped with the reason
where liger-kernel does not import); bf16, sdpa unless flash-attn imports, no gradient checkpointing,
3 warm-up steps then 10 measured, 1 round. The compile and padding-free variants are left out here:
compiling 32 layers takes minutes, and a batch of one full row has no padding to drop.

With --dry (the CPU): the same two runs at the CPU's size (--scale 16: hidden 256, 2 and 1 layers,
rows of 64-128 tokens, 1 warm-up and 2 measured steps) to check the wiring; its numbers say nothing
of the GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).with_name("bench_trainer_speed.py")
VARIANTS = "trl,trl+liger,memfit,memfit+liger"
RUNS = {"lora": ("--finetunes", "lora", "--layers", "32"), "full": ("--finetunes", "full", "--layers", "8")}
GPU_ARGS = ("--device", "cuda", "--seq-len", "4096", "--rows", "16", "--warmup", "3", "--steps", "10")
DRY_RUNS = {"lora": ("--finetunes", "lora", "--layers", "2"), "full": ("--finetunes", "full", "--layers", "1")}
DRY_ARGS = ("--device", "cpu", "--scale", "16", "--seq-len", "128", "--min-len", "64", "--rows", "8")
DRY_ARGS += ("--warmup", "1", "--steps", "2", "--precision", "bf16")
RUN_S = 240  # one run's limit on a GPU (model builds, FusedAdam's JIT build if not done yet, 4 variants)
DRY_RUN_S = 1200  # on the CPU: 13 s a run at load 4, minutes when other jobs take the 2 cores
MIN_S = 60  # no run starts with less left before the deadline


def command(finetune: str, cuda: bool, out: Path) -> list[str]:
    runs, args = (RUNS, GPU_ARGS) if cuda else (DRY_RUNS, DRY_ARGS)
    common = ("--model", "llama-3.1-8b", "--methods", "sft", "--batch", "1", "--rounds", "1", "--variants", VARIANTS)
    return [sys.executable, str(BENCH), *args, *common, *runs[finetune], "--out", str(out)]


def stage_trainer_speed(
    cuda: bool, work: Path, deadline: float | None, done: dict[str, dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """One row per run (lora, full): the benchmark's report (its best-of table, peaks, settings) as
    `measured`, or why it did not run or failed; `done`: rows of an earlier partial run, kept where ok."""
    rows = []
    for finetune in RUNS:
        row: dict[str, Any] = {"id": f"trainer-speed-{finetune}", "method": "sft"}
        if (done or {}).get(row["id"], {}).get("status") == "ok":
            rows.append(done[row["id"]])
            continue
        limit = RUN_S if cuda else DRY_RUN_S
        left = limit if deadline is None else min(limit, deadline - time.time())
        if left < MIN_S:
            rows.append(row | {"status": "skipped: deadline (--deadline)"})
            continue
        out = work / f"trainer_speed_{finetune}.json"
        out.unlink(missing_ok=True)
        cmd = command(finetune, cuda, out)
        t0 = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired as e:
            tail = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
            # cut by the deadline: the stage stays partial and runs this again next time
            why = "skipped: deadline (--deadline)" if left < limit else f"error: not finished in {left:.0f} s"
            rows.append(row | {"status": why, "output": tail[-3000:]})
            continue
        row |= {"command": " ".join(cmd[1:]), "wall_s": round(time.time() - t0, 1)}
        if p.returncode != 0 or not out.exists():
            rows.append(row | {"status": f"error: exit {p.returncode}", "error": (p.stdout + p.stderr)[-3000:]})
            continue
        report = json.loads(out.read_text())
        report.pop("rounds", None)  # one round: the best-of table holds the same numbers
        rows.append(row | {"status": "ok", "measured": report, "table": table_lines(report)})
    return rows


def table_lines(report: dict[str, Any]) -> list[str]:
    """The run's best-of table as printed lines (gpu_evidence.py's table shows them)."""
    out = []
    for r in report["best"]:
        vs = f"{r['vs_trl']:.3f}x TRL" if r.get("vs_trl") is not None else ""
        mfu = f"MFU {r['mfu']:.1%}" + (f" ({r['mfu_vendor']:.1%} of datasheet)" if "mfu_vendor" in r else "")
        out.append(f"{r['finetune']} {r['variant']}: {r['tokens_per_s']:.0f} tok/s, {mfu}, {vs}")
    out += [f"{k}: {v}" for k, v in report.get("skipped", {}).items()]
    return out
