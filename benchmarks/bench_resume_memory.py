"""Memory at resume against the training peak and the estimate, per ZeRO stage (the CPU).

    .venv/bin/python benchmarks/bench_resume_memory.py [--only SHAPE ...] [--out FILE]

Each shape trains the demo model (full fine-tune, micro batch 1, 24 tokens: the model states
dominate, as on a large model) for 4 steps on 2 CPU ranks with checkpoints at steps 2 and 4,
then `memfit.workflow.resume_check.verify_resume` relaunches it from step 2 and compares. Printed
per shape: the training peak and the resume peak (live tensor bytes per rank,
`memfit.train.memory.AllocationTracker`; the resume window is the model build and the checkpoint
load), the estimate's resume phase, host RSS of both, and whether the resume was bit-exact.
`--out` writes the rows as JSON (benchmarks/results/resume_memory_cpu.json is the committed run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_qlora_memory import REPO, build  # noqa: E402

# name: (zero, offload_optimizer, precision)
SHAPES = {
    "z0-fp32": (0, "none", "fp32"),
    "z1-fp32": (1, "none", "fp32"),
    "z2-fp32": (2, "none", "fp32"),
    "z3-fp32": (3, "none", "fp32"),
    "z2-offload-fp32": (2, "cpu", "fp32"),
    "z3-offload-fp32": (3, "cpu", "fp32"),
    "z0-bf16": (0, "none", "bf16"),
    "z2-bf16": (2, "none", "bf16"),
    "z3-bf16": (3, "none", "bf16"),
}
WORLD = 2


def measure(root: Path, name: str) -> dict:
    from memfit.estimate import catalog, estimate
    from memfit.space import Candidate
    from memfit.train.launch import launch
    from memfit.train.run_config import RunConfig
    from memfit.workflow.resume_check import verify_resume

    zero, offload, precision = SHAPES[name]
    cand = Candidate(
        zero=zero, offload_optimizer=offload, precision=precision, finetune="full", micro_batch=1,
        grad_accum=1, seq_len=24, attn="sdpa", grad_ckpt=False,
    )  # fmt: skip
    out = root / "resume" / name
    run = RunConfig(
        method="sft", model_path=str(root / "model"), data_dir=str(root / "sft"), out_dir=str(out / "train"),
        candidate=cand.to_dict(), lr=3e-3, max_steps=4, warmup_steps=1, save_every=2, keep_last=2,
        eval_every=100, log_every=100,
    )  # fmt: skip
    run.save(out / "run.json")
    if launch(out / "run.json", WORLD, log=out / "train.log") != 0:
        raise RuntimeError(f"{name}: training failed (log {out / 'train.log'})")
    res = verify_resume(out / "run.json", WORLD, out / "verify_resume.json", out / "verify_resume.log")
    est = estimate(catalog.model(str(root / "model")), catalog.gpu("cpu"), WORLD, 1, "sft", cand, budget_bytes=8 << 30)
    return {
        "name": name,
        "candidate": cand.to_dict(),
        "training_peak_bytes": res["training_peak_allocated_bytes"],
        "resume_peak_bytes": res["resume_peak_allocated_bytes"],
        "predicted_resume_bytes": None if est.invalid else est.phases["resume"],
        "training_host_rss_bytes": res["training_host_rss_bytes"],
        "resume_host_rss_bytes": res["resume_host_rss_bytes"],
        "bit_exact": bool(res["losses_bitwise_equal"] and res["weights_bitwise_equal"]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", choices=list(SHAPES), help="these shapes only")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    ap.add_argument(
        "--model-config",
        type=Path,
        default=REPO / "config/models/demo-tiny.json",
        help="the model to train (benchmarks/resume-host-136m.json: files that outweigh a rank's own RSS)",
    )
    ap.add_argument("--work", type=Path, help="where the model, data and runs go (default: per model config)")
    args = ap.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    root = build(args.work or REPO / f"benchmarks/results/.work/resume-{args.model_config.stem}", args.model_config)
    t0 = time.perf_counter()
    rows = [measure(root, n) for n in args.only or list(SHAPES)]
    print(
        f"{'shape':18s} {'training':>12s} {'resume':>12s} {'res/train':>9s} {'predicted':>12s} {'res/pred':>8s} {'RSS res/train':>13s} exact"
    )
    for r in rows:
        pred = r["predicted_resume_bytes"]
        print(
            f"{r['name']:18s} {r['training_peak_bytes']:12,d} {r['resume_peak_bytes']:12,d} "
            f"{r['resume_peak_bytes'] / r['training_peak_bytes']:9.3f} "
            f"{(f'{pred:,d}' if pred is not None else 'n/a'):>12s} "
            f"{(r['resume_peak_bytes'] / pred if pred else float('nan')):8.4f} "
            f"{r['resume_host_rss_bytes'] / r['training_host_rss_bytes']:13.3f} {r['bit_exact']}"
        )
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.out:
        args.out.write_text(json.dumps({"world_size": WORLD, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
