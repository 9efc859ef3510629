"""The longest sequence that fits the CPU budget: SP=1, SP=2, SP=2 + tiled MLP, SP=2 + tiled MLP +
activation offload, measured by probes and predicted by the estimator.

    .venv/bin/python benchmarks/bench_long_context.py [--out FILE] [--budget-mib 96] [--step 64]

The demo model (config/models/demo-tiny.json, data under benchmarks/results/.work/qlora, made
once), SFT, full fine-tune in fp32, ZeRO-3, micro batch 1, gradient checkpointing and the chunked
loss (the ALST baseline: DeepSpeed ZeRO-3, checkpointing, tiled logits), sdpa, on 2 CPU ranks; the
budget is the demo's `cpu_memory_mib` per rank (config/config.yaml). For each lever set:
- predicted: the longest multiple of `--step` tokens whose estimated training peak per rank
  (`Estimate.training_peak_bytes`, memfit.estimate on `cpu`) is within the budget;
- measured: the same search over probes (`memfit.workflow.probe.run_probe`: 2 steps on the
  worst-case batch, peak allocated bytes per rank from memfit.train.memory.AllocationTracker),
  started at the prediction and bracketed from there.
On the CPU the activation offload moves nothing (DeepSpeed skips a device without streams: the
host is the device), so its row equals the tiled row by construction; on a GPU it is the lever
that matters most (docs/long-context.md). docs/long-context.md quotes a run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_qlora_memory import REPO, WORLD, build, probe_candidate  # noqa: E402

LEVERS = {
    "SP=1": {},
    "SP=2": {"sequence_parallel": 2},
    "SP=2 + tiled MLP": {"sequence_parallel": 2, "tiled_mlp": True},
    "SP=2 + tiled MLP + activation offload": {"sequence_parallel": 2, "tiled_mlp": True, "activation_offload": True},
}


def base_candidate():
    from memfit.space import Candidate

    return Candidate(
        zero=3, precision="fp32", finetune="full", micro_batch=1, grad_accum=1, grad_ckpt=True,
        loss_impl="chunked", attn="sdpa", seq_len=1024,
    )  # fmt: skip


def longest(fits, lo: int, hi: int, step: int) -> int:
    """The largest multiple of `step` in [lo, hi) for which `fits` holds (`fits(lo)` true, `fits(hi)` false)."""
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def predicted_longest(arch, cand, budget: int, step: int) -> int:
    from memfit.estimate import estimate
    from memfit.estimate.models import catalog

    def fits(seq: int) -> bool:
        e = estimate(
            arch, catalog.gpu("cpu"), WORLD, 1, "sft", dataclasses.replace(cand, seq_len=seq), budget_bytes=budget
        )
        return not e.invalid and e.training_peak_bytes <= budget

    return longest(fits, step, 1 << 22, step)


def measured_longest(root: Path, cand, budget: int, step: int, start: int, work: Path) -> tuple[int, list[dict]]:
    """The probes' longest, bracketed from `start` (the prediction) in steps of an eighth."""
    probes: list[dict] = []

    def fits(seq: int) -> bool:
        c = dataclasses.replace(cand, seq_len=seq)
        res, est = probe_candidate(root, "sft", c, work, c.id, steps=2)
        m, p = res["peak_allocated_bytes"], est.training_peak_bytes
        probes.append({"seq_len": seq, "peak_bytes": m, "predicted_peak_bytes": p})
        print(f"    probe {seq:>6,d} tokens: {m / 2**20:7.1f} MiB, estimate {p / m - 1:+.1%}", flush=True)
        return res["peak_allocated_bytes"] <= budget

    grow = max(step, start // 8 // step * step)
    if fits(start):
        lo, hi = start, start + grow
        while fits(hi):
            lo, hi = hi, hi + grow
    else:
        lo, hi = max(step, start - grow), start
        while not fits(lo):
            lo, hi = max(step, lo - grow), lo
    return longest(fits, lo, hi, step), probes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    ap.add_argument("--budget-mib", type=int, default=96, help="device budget per rank (the demo's cpu_memory_mib)")
    ap.add_argument("--step", type=int, default=64, help="sequence length granularity, tokens")
    ap.add_argument("--work", type=Path, default=REPO / "benchmarks/results/.work/qlora")
    args = ap.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from memfit.estimate.models import catalog

    root = build(args.work)
    arch = catalog.model(str(root / "model"))
    budget = args.budget_mib << 20
    t0 = time.perf_counter()
    rows = []
    for name, levers in LEVERS.items():
        cand = dataclasses.replace(base_candidate(), **levers)
        predicted = predicted_longest(arch, cand, budget, args.step)
        print(f"{name}: predicted {predicted:,d} tokens", flush=True)
        measured, probes = measured_longest(root, cand, budget, args.step, predicted, root / "long-context")
        rows.append(
            {
                "levers": name,
                "candidate": cand.to_dict(),
                "predicted": predicted,
                "measured": measured,
                "probes": probes,
            }
        )
    print(f"\nlongest sequence within {args.budget_mib} MiB per rank, {WORLD} CPU ranks (tokens):")
    print(f"{'levers':40s} {'measured':>9s} {'predicted':>9s} {'error':>7s} {'vs SP=1':>8s}")
    for r in rows:
        m, p = r["measured"], r["predicted"]
        print(f"{r['levers']:40s} {m:9,d} {p:9,d} {p / m - 1:+7.1%} {m / rows[0]['measured']:7.2f}x")
    errors = [p["predicted_peak_bytes"] / p["peak_bytes"] - 1 for r in rows for p in r["probes"]]
    print(f"estimated peak at every probed length: {min(errors):+.1%} to {max(errors):+.1%} of the probe's")
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.out:
        out = {"world_size": WORLD, "budget_bytes": budget, "step": args.step, "rows": rows}
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
