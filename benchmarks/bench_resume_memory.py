"""Memory at resume against the training peak and the estimate, per ZeRO stage (the CPU).

    .venv/bin/python benchmarks/bench_resume_memory.py [--model-config JSON] [--only SHAPE ...] [--out FILE]

Each shape trains the demo model (full fine-tune, micro batch 1, 24 tokens: the model states
dominate, as on a large model) for 4 steps on 2 CPU ranks with checkpoints at steps 2 and 4,
then `memfit.workflow.resume_check.verify_resume` relaunches it from step 2 and compares, twice:
with memfit's loader and with DeepSpeed's own (`MEMFIT_CHECKPOINT_LOADER=deepspeed`: files read
whole, the baseline of the same run). Printed per shape: the training peak and the resume peak
(live tensor bytes per rank, `memfit.train.memory.AllocationTracker`; the resume window is the
model build and the checkpoint load), the estimate's resume phase, host RSS at resume over host
RSS of training (peak RSS of the largest rank) with each loader, and whether the resume was
bit-exact. `--model-config benchmarks/resume-host-136m.json` trains a 136M-parameter model whose
files outweigh a rank's own ~0.6 GB, where the host difference shows. `--out` writes the rows as
JSON (benchmarks/results/resume_memory_cpu.json and resume_memory_136m_cpu.json are the
committed runs).
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

# name: the candidate's fields (full fine-tune, micro batch 1 of 24 tokens, sdpa, no checkpointing)
SHAPES = {
    "z0-fp32": dict(zero=0),
    "z1-fp32": dict(zero=1),
    "z2-fp32": dict(zero=2),
    "z3-fp32": dict(zero=3),
    "z2-offload-fp32": dict(zero=2, offload_optimizer="cpu"),
    "z2-offload-pin-fp32": dict(zero=2, offload_optimizer="cpu", pin_memory=True),
    "z3-offload-fp32": dict(zero=3, offload_optimizer="cpu"),
    "z3-offload0.5-fp32": dict(zero=3, offload_optimizer="cpu", offload_ratio=0.5),
    "z0-bf16": dict(zero=0, precision="bf16"),
    "z2-bf16": dict(zero=2, precision="bf16"),
    "z3-bf16": dict(zero=3, precision="bf16"),
}
WORLD = 2


def measure(root: Path, name: str, reuse: bool = False) -> dict:
    from memfit.estimate import estimate
    from memfit.estimate.models import catalog
    from memfit.space import Candidate
    from memfit.train.checkpoint import LOADER_ENV
    from memfit.train.launch import launch
    from memfit.train.run_config import RunConfig
    from memfit.workflow.resume_check import verify_resume

    cand = Candidate(
        **{"precision": "fp32"} | SHAPES[name], finetune="full", micro_batch=1, grad_accum=1, seq_len=24,
        attn="sdpa", grad_ckpt=False,
    )  # fmt: skip
    out = root / "resume" / name
    run = RunConfig(
        method="sft", model_path=str(root / "model"), data_dir=str(root / "sft"), out_dir=str(out / "train"),
        candidate=cand.to_dict(), lr=3e-3, max_steps=4, warmup_steps=1, save_every=2, keep_last=2,
        eval_every=100, log_every=100,
    )  # fmt: skip
    base = out / "deepspeed-loader"
    done = [out / "verify_resume.json", base / "verify_resume.json"]
    if reuse and all(p.exists() for p in done):  # --reuse: the checks a finished run of this shape wrote
        res, ds = (json.loads(p.read_text()) for p in done)
    else:
        run.save(out / "run.json")
        if launch(out / "run.json", WORLD, log=out / "train.log") != 0:
            raise RuntimeError(f"{name}: training failed (log {out / 'train.log'})")
        res = verify_resume(out / "run.json", WORLD, out / "verify_resume.json", out / "verify_resume.log")
        os.environ[LOADER_ENV] = "deepspeed"  # the relaunched ranks inherit it
        try:
            ds = verify_resume(out / "run.json", WORLD, base / "verify_resume.json", base / "verify_resume.log")
        finally:
            del os.environ[LOADER_ENV]
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
        "deepspeed_loader": {
            "resume_peak_bytes": ds["resume_peak_allocated_bytes"],
            "resume_host_rss_bytes": ds["resume_host_rss_bytes"],
            "bit_exact": bool(ds["losses_bitwise_equal"] and ds["weights_bitwise_equal"]),
        },
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
    ap.add_argument(
        "--reuse", action="store_true", help="print (and --out) the shapes already measured in the work folder again"
    )
    args = ap.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    root = build(args.work or REPO / f"benchmarks/results/.work/resume-{args.model_config.stem}", args.model_config)
    t0 = time.perf_counter()
    rows = [measure(root, n, args.reuse) for n in args.only or list(SHAPES)]
    print(
        f"{'shape':18s} {'training':>12s} {'resume':>12s} {'res/train':>9s} {'predicted':>12s} {'res/pred':>8s}"
        f" {'RSS res/train':>13s} {'DS loader: resume':>17s} {'res/train':>9s} {'RSS res/train':>13s} exact"
    )
    for r in rows:
        pred, ds = r["predicted_resume_bytes"], r["deepspeed_loader"]
        train, rss = r["training_peak_bytes"], r["training_host_rss_bytes"]
        print(
            f"{r['name']:18s} {train:12,d} {r['resume_peak_bytes']:12,d} {r['resume_peak_bytes'] / train:9.3f} "
            f"{(f'{pred:,d}' if pred is not None else 'n/a'):>12s} "
            f"{(r['resume_peak_bytes'] / pred if pred else float('nan')):8.4f} "
            f"{r['resume_host_rss_bytes'] / rss:13.3f} {ds['resume_peak_bytes']:17,d} "
            f"{ds['resume_peak_bytes'] / train:9.3f} {ds['resume_host_rss_bytes'] / rss:13.3f} "
            f"{r['bit_exact']}/{ds['bit_exact']}"
        )
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.out:
        meta = {"world_size": WORLD, "model_config": str(args.model_config.resolve().relative_to(REPO))}
        args.out.write_text(json.dumps(meta | {"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
