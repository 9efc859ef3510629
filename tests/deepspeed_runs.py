"""Real DeepSpeed training runs for the tests (CPU accelerator, gloo): the run config a test
starts from, how it is launched, and the runs several test files share (`SharedRuns`)."""

from __future__ import annotations

import dataclasses
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
    # resolve: the run's input digests, as memfit launch records them
    rc = launch(out / "run.json", nproc, log=out / "log.txt", timeout_s=timeout_s, resolve=True)
    assert rc == 0, (out / "log.txt").read_text()[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_side_by_side(*cfgs: RunConfig, nproc: int = 2) -> list[list[dict]]:
    """`run` of independent runs, two at a time; their metrics rows in the order given.

    Each run is its own torchrun (own rendezvous port, ranks and out_dir); what the tests compare
    (losses, live tensor bytes per rank) does not depend on what else the machine runs, and the
    runs' start-up (imports, DeepSpeed init), which leaves a core idle, overlaps."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda cfg: run(cfg, nproc), cfgs))


class SharedRuns:
    """Runs several test files read, each made once per session (the `shared_runs` fixture).

    A test gets `(run directory, metrics rows)` and must not change the directory: one that
    resumes, kills or rewrites a run copies it first. The runs:

    - `sft-z0`, `sft-z2`, `sft-z3`: `base_run` SFT under ZeRO-0/2/3 (6 steps, checkpoints at 3
      and 6; 2 ranks, micro batch 8, global batch 16);
    - `sft-z3-resumed`: `sft-z3` "killed" after step 4 (`stop_after_step`, the checkpoint of
      step 3 the newest), then relaunched unchanged: it resumes from step 3. Rows: the relaunch's.
      `first_rows["sft-z3-resumed"]`: the interrupted launch's rows, and whether it exported a model.
    """

    STAGES = {"sft-z0": 0, "sft-z2": 2, "sft-z3": 3}

    def __init__(self, demo_model, data, root: Path) -> None:
        self.demo_model, self.data, self.root = demo_model, data, Path(root)
        self.done: dict[str, tuple[Path, list[dict]]] = {}
        self.first_rows: dict[str, tuple[list[dict], bool]] = {}

    def config(self, name: str) -> RunConfig:
        zero = self.STAGES[name.removesuffix("-resumed")]
        return base_run(self.demo_model, self.data, self.root / name, zero=zero)

    def _make(self, name: str) -> list[dict]:
        cfg = self.config(name)
        if name.endswith("-resumed"):
            rows = run(dataclasses.replace(cfg, stop_after_step=4))
            self.first_rows[name] = (rows, (Path(cfg.out_dir) / "model").exists())
        return run(cfg)

    def prefetch(self, *names: str) -> None:
        """Make the runs not made yet, two at a time (see `run_side_by_side`)."""
        todo = [n for n in dict.fromkeys(names) if n not in self.done]
        with ThreadPoolExecutor(max_workers=2) as pool:
            for name, rows in zip(todo, pool.map(self._make, todo), strict=True):
                self.done[name] = (self.root / name, rows)

    def __getitem__(self, name: str) -> tuple[Path, list[dict]]:
        self.prefetch(name)
        return self.done[name]
