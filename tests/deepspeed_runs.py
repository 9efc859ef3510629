"""Real DeepSpeed training runs for the tests (CPU accelerator, gloo): the run config a test
starts from and how it is launched, shared by test_train and test_resume_universal."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from memfit.train.launch import launch
from memfit.train.run_config import RunConfig


def base_run(demo_model, data, out, method="sft", **cand) -> RunConfig:
    """6 steps of the demo model on the demo data, a checkpoint and an evaluation every 3."""
    return RunConfig(
        method=method,
        model_path=str(demo_model),
        data_dir=str(data / method),
        out_dir=str(out),
        candidate={"zero": 2, "precision": "fp32", "seq_len": 32, "micro_batch": 8, "grad_accum": 1, **cand},
        max_steps=6,
        lr=3e-3,
        warmup_steps=2,
        save_every=3,
        eval_every=3,
        log_every=1,
        dpo={"beta": 0.1} if method == "dpo" else {},
    )


def run(cfg: RunConfig, nproc: int = 2, timeout_s: int = 900) -> list[dict]:
    """Launch `cfg` on `nproc` ranks; the metrics rows it wrote (the log's tail if it failed)."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg.save(out / "run.json")
    rc = launch(out / "run.json", nproc, log=out / "log.txt", timeout_s=timeout_s)
    assert rc == 0, (out / "log.txt").read_text()[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_side_by_side(*cfgs: RunConfig, nproc: int = 2) -> list[list[dict]]:
    """`run` of independent runs, two at a time; their metrics rows in the order given.

    Each run is its own torchrun (own rendezvous port, ranks and out_dir); what the tests compare
    (losses, live tensor bytes per rank) does not depend on what else the machine runs, and the
    runs' start-up (imports, DeepSpeed init), which leaves a core idle, overlaps."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda cfg: run(cfg, nproc), cfgs))
