"""Replay the committed H200 step-time calibration against its probes (issue #42), on the CPU.

    PYTHONPATH=src python benchmarks/replay_h200_calibration.py

Reads benchmarks/results/gpu_check_h200/replay/ (calibration.json and the probe JSONs of the
2026-11-28 gpu-demo run, copied from call1_logs.tgz) and prints, for each probe, the calibrated
prediction by term (memfit.estimate.time.timing.predict, demo-gpu's 24 layers) next to the
probe's first, steady and last step. The totals equal gpu_check.json's predicted step times.
"""

from __future__ import annotations

import json
from pathlib import Path

from memfit.estimate.time import timing
from memfit.space import Candidate

HERE = Path(__file__).resolve().parent / "results" / "gpu_check_h200" / "replay"
LAYERS = 24  # config/models/demo-gpu.json num_hidden_layers (calibration.json model.num_layers)


def main() -> int:
    cal = timing.load(HERE / "calibration.json")
    for f in sorted(HERE.glob("*/*.json")):
        method, p = f.parent.name, json.loads(f.read_text())
        terms = timing.predict(cal, Candidate.from_dict(p["candidate"]), method, LAYERS)
        total = sum(terms.values())
        steady = p["steady_step_times_s"]
        print(
            f"{method} {p['id']}: predicted {total:.3f} s (probe file {p['predicted']['step_time_s']:.3f}) = "
            + " + ".join(f"{k} {v:.3f}" for k, v in terms.items())
            + f"; measured first {p['first_step_time_s']:.3f}, steady {steady}, median {p['step_time_s']:.3f};"
            f" predicted/last {total / steady[-1]:.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
