"""QLoRA on the CPU: the estimator's peak against a real probe, shape by shape (target: within 3%).

    .venv/bin/python benchmarks/bench_qlora_memory.py [--only NAME ...] [--out FILE]

Each row builds nothing new: the demo model (config/models/demo-tiny.json) and the demo data
(max_len 32) are made once under benchmarks/results/.work/qlora, then every shape is probed by
`memfit.workflow.probe.run_probe` (the trainer's real step: bitsandbytes 0.50 NF4 weights with
double quantization, peft LoRA on top, DeepSpeed on 2 CPU ranks, 3 steps on the worst-case batch,
memory from `memfit.train.memory.AllocationTracker`) and estimated by `memfit.estimate.estimate`
for the same candidate on `cpu`. Printed per shape: measured and predicted peak allocated bytes
per rank and their ratio, then the largest deviation. `--out` writes the rows as JSON
(benchmarks/results/qlora_memory_cpu.json is the committed run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name: (method, candidate fields). fp32 on 2 ranks, global batch 16 (grad_accum from micro_batch).
SHAPES = {
    "sft-z0-r8-s32-mb8": ("sft", dict(zero=0, lora_rank=8, seq_len=32, micro_batch=8)),
    "sft-z2-r16-s32-mb8": ("sft", dict(zero=2, lora_rank=16, seq_len=32, micro_batch=8)),
    "sft-z3-r8-s32-mb8": ("sft", dict(zero=3, lora_rank=8, seq_len=32, micro_batch=8)),
    "sft-z2-r8-s24-mb4-gc": ("sft", dict(zero=2, lora_rank=8, seq_len=24, micro_batch=4, grad_ckpt=True)),
    "sft-z0-r64-s32-mb2-gc": ("sft", dict(zero=0, lora_rank=64, seq_len=32, micro_batch=2, grad_ckpt=True)),
    "dpo-z2-r8-s32-mb4-adapter": ("dpo", dict(zero=2, lora_rank=8, seq_len=32, micro_batch=4, ref="adapter")),
    "dpo-z0-r16-s24-mb2-gc-precomputed": (
        "dpo",
        dict(zero=0, lora_rank=16, seq_len=24, micro_batch=2, grad_ckpt=True, ref="precomputed"),
    ),
    "dpo-z2-r8-s32-mb4-model": ("dpo", dict(zero=2, lora_rank=8, seq_len=32, micro_batch=4, ref="model")),
}
WORLD = 2


def candidate(fields: dict, finetune: str = "qlora"):
    from memfit.space import Candidate

    c = dict(attn="sdpa", precision="fp32", finetune=finetune, grad_ckpt=False, ref="model") | fields
    c["grad_accum"] = 16 // (c["micro_batch"] * WORLD)
    return Candidate(**c)


def build(root: Path, model_config: Path = REPO / "config/models/demo-tiny.json") -> Path:
    """The demo model (or another config built the same way) and its SFT/DPO data under `root` (once)."""
    from memfit.data import prepare
    from memfit.workflow.demo import build_demo_model

    model = root / "model"
    if not (model / "config.json").exists():
        build_demo_model(model_config, REPO / "data/demo", model)
    for m in ("sft", "dpo"):
        if not (root / m).exists():
            prepare(m, REPO / f"data/demo/{m}.jsonl", model, root / m, max_len=32, eval_fraction=0.01)
    return root


def probe_candidate(root: Path, method: str, cand, work: Path, stem: str, steps: int = 3):
    """Probe `cand` on WORLD CPU ranks (the trainer's real step, memfit.workflow.probe.run_probe;
    run, result and log under `work` named `stem`) and estimate it on `cpu`: (probe result, Estimate)."""
    from memfit.estimate import estimate
    from memfit.estimate.models import catalog
    from memfit.train.run_config import RunConfig
    from memfit.workflow.probe import run_probe

    work.mkdir(parents=True, exist_ok=True)
    log = work / f"{stem}.log"
    res = run_probe(
        RunConfig(
            method=method,
            model_path=str(root / "model"),
            data_dir=str(root / method),
            out_dir=str(work / stem),
            candidate=cand.to_dict(),
            dpo={"beta": 0.1} if method == "dpo" else {},
        ),
        nproc=WORLD,
        out_json=work / f"{stem}.json",
        log=log,
        steps=steps,
    )
    if res["status"] != "ok":
        raise RuntimeError(f"{stem}: probe {res['status']}: {res.get('error')} (log {log})")
    est = estimate(catalog.model(str(root / "model")), catalog.gpu("cpu"), WORLD, 1, method, cand, budget_bytes=8 << 30)
    return res, est


def probe_and_estimate(root: Path, name: str, finetune: str = "qlora") -> dict:
    """One shape: the probe's peak and the estimator's, per rank."""
    method, fields = SHAPES[name]
    cand = candidate(fields, finetune)
    res, est = probe_candidate(root, method, cand, root, f"{name}-{finetune}")
    return {
        "name": name,
        "candidate": cand.to_dict(),
        "measured_peak_bytes": res["peak_allocated_bytes"],
        "predicted_peak_bytes": est.training_peak_bytes,  # a probe does not resume
        "ratio": res["peak_allocated_bytes"] / est.training_peak_bytes,
        "phases": est.phases,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", choices=list(SHAPES), help="these shapes only")
    ap.add_argument("--finetune", default="qlora", choices=["qlora", "lora"], help="lora: the same shapes unquantized")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    ap.add_argument("--work", type=Path, default=REPO / "benchmarks/results/.work/qlora")
    args = ap.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    root = build(args.work)
    names = args.only or list(SHAPES)
    t0 = time.perf_counter()
    # two probes at a time: each its own torchrun; what it measures (live tensor bytes per rank)
    # does not depend on what else runs
    with ThreadPoolExecutor(max_workers=2) as pool:
        rows = list(pool.map(lambda n: probe_and_estimate(root, n, args.finetune), names))
    print(f"{'shape':40s} {'measured':>12s} {'predicted':>12s} {'ratio':>7s}")
    for r in rows:
        print(f"{r['name']:40s} {r['measured_peak_bytes']:12,d} {r['predicted_peak_bytes']:12,d} {r['ratio']:7.4f}")
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    print(f"largest deviation: {worst['name']} {worst['ratio'] - 1:+.2%} ({time.perf_counter() - t0:.0f} s)")
    if args.out:
        args.out.write_text(json.dumps({"world_size": WORLD, "rows": rows}, indent=1) + "\n")
    return 0 if all(abs(r["ratio"] - 1) <= 0.03 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
