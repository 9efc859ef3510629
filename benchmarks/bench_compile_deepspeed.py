"""One DeepSpeed SFT step of the demo model, eager or with its decoder layers compiled, broken down
into forward, backward and DeepSpeed's step, with dynamo's graph counts (issue #45).

Run on every rank by torchrun (2 CPU ranks, gloo), as memfit's probes run: the demo model
(config/models/demo-tiny.json) built by memfit.workflow.demo, the micro batch the calibration
times (`memfit.train.calibrate._rows`: --mb rows of exactly --seq tokens), the engine
`memfit.train.dsconfig.build` configures (fp32, gradient accumulation 1), and the steps under the
CPU's AllocationTracker as every CPU probe, calibration and training step runs (--tracker none:
without it; --tracker old: as before issue #45's fix, when dynamo skipped every frame under it).

Prints one JSON line per rank: torch threads, the first step (where the layers compile), the
median of the steps from the third on per phase (ms), dynamo's unique graphs after each step
(the same from the first step on: nothing recompiles), its graph breaks and their reasons, and
the tracker's peak bytes. The load average before each run is the caller's to record.

Usage (from the repository root, with OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 as memfit.train.launch
sets them for 2 ranks on 2 cores):
  .venv/bin/torchrun --nproc_per_node 2 benchmarks/bench_compile_deepspeed.py --model DIR \
      [--zero 0|2|3] [--compile] [--tracker new|old|none] [--mb 8] [--seq 24] [--steps 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from memfit.space import Candidate  # noqa: E402
from memfit.train import dsconfig  # noqa: E402
from memfit.train.calibrate import _rows  # noqa: E402
from memfit.train.compile import compile_layers, compiled_graphs  # noqa: E402
from memfit.train.memory import AllocationTracker  # noqa: E402
from memfit.train.modeling import hidden_size, load_model  # noqa: E402
from memfit.train.steps import StepRunner  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the demo model's directory (python -m memfit.workflow.demo model)")
    ap.add_argument("--zero", type=int, default=0, choices=[0, 2, 3])
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--tracker", choices=["new", "old", "none"], default="new")
    ap.add_argument("--mb", type=int, default=8)
    ap.add_argument("--seq", type=int, default=24)
    ap.add_argument("--steps", type=int, default=16)
    a = ap.parse_args()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    if a.tracker == "old":  # the tracker as it was: dynamo skips every frame while it is on
        AllocationTracker.ignore_compile_internals = classmethod(lambda cls: False)
    cand = Candidate.from_dict(
        {
            "zero": a.zero,
            "precision": "fp32",
            "seq_len": a.seq,
            "micro_batch": a.mb,
            "grad_accum": 1,
            "compile": a.compile,
        }
    )
    cfg = dsconfig.build(cand, tdist.get_world_size(), lr=1e-5, total_steps=1000, hidden_size=hidden_size(a.model))
    hf = None
    if a.zero == 3:
        from transformers.integrations import HfDeepSpeedConfig

        hf = HfDeepSpeedConfig(cfg)  # partitioned as it loads, as training does
    model = load_model(a.model, cand, trainable=True)
    vocab = int(model.config.vocab_size)
    if a.compile:
        compile_layers(model)
    params = [p for p in model.parameters() if p.requires_grad]
    engine = deepspeed.initialize(model=model, model_parameters=params, config=cfg)[0]
    engine.train()
    del hf
    runner = StepRunner("sft", engine, None, 0)
    rows = _rows("sft", cand, vocab)
    tracker = AllocationTracker("cpu") if a.tracker != "none" else None
    if tracker:
        tracker.__enter__()
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "step": [], "total": []}
    graphs = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        loss, _, _ = runner.loss(rows)
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        t3 = time.perf_counter()
        for k, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
            phases[k].append(dt)
        graphs.append(compiled_graphs())
    if tracker:
        tracker.__exit__(None, None, None)
    out = {
        "rank": tdist.get_rank(),
        "zero": a.zero,
        "compile": a.compile,
        "tracker": a.tracker,
        "torch_threads": torch.get_num_threads(),
        "first_step_ms": round(phases["total"][0] * 1000),
        "median_ms_from_step_3": {k: round(statistics.median(v[2:]) * 1000, 1) for k, v in phases.items()},
        "graphs_by_step": graphs,
        "graph_breaks": sum(counters["graph_break"].values()),
        "break_reasons": {k[:200]: v for k, v in counters["graph_break"].items()},
        "peak_bytes": tracker.peak_bytes if tracker else None,
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
