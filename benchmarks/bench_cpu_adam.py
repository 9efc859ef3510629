"""DeepSpeedCPUAdam's step rate on this machine: the rate memfit's step time prices an offloaded
optimizer at (`Settings.cpu_adam_params_per_s_per_core`, memfit.estimate.time.runtime_costs).

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/bench_cpu_adam.py [--sizes 1e6,1e7,5e7]
        [--threads N] [--reps 5] [--json out.json]

For each size: one fp32 parameter of that many elements with an fp32 gradient, DeepSpeedCPUAdam
(deepspeed.ops.adam, the C++ op memfit's trainer runs for `offload_optimizer: cpu`) stepped
`--reps` times after one warm-up step; the median step's parameters per second, and per core
(torch's intra-op threads, which the op's OpenMP loop uses). The figure per core and per rank is
what the calibrate rule measures on the target machine when the search space offloads the
optimizer (`calibration.json`'s `cpu_adam`: one block of memfit.train.calibrate_cpu_adam.CPU_ADAM_BLOCK
parameters on every rank at once, its threads the rank's); this benchmark measures other sizes
and thread counts in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1e6,1e7,5e7", help="parameter counts, comma-separated")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch intra-op threads")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", help="write the measurements here")
    args = p.parse_args(argv)
    try:
        sizes = [int(float(s)) for s in args.sizes.split(",")]
    except ValueError:
        print(f"error: --sizes {args.sizes!r} is not a comma-separated list of numbers", file=sys.stderr)
        return 2
    if not sizes or min(sizes) < 1 or args.threads < 1 or args.reps < 1:
        print("error: --sizes, --threads and --reps must be positive", file=sys.stderr)
        return 2
    import torch

    from memfit.train.calibrate_cpu_adam import cpu_adam_seconds  # what the calibrate rule measures

    torch.set_num_threads(args.threads)
    rows = []
    print(f"DeepSpeedCPUAdam, fp32, {args.threads} thread(s), median of {args.reps} steps")
    print(f"{'params':>12} {'step s':>9} {'params/s':>12} {'per core':>12}")
    for n in sizes:
        s = cpu_adam_seconds(n, args.reps)
        rate = n / s
        rows.append({"params": n, "step_s": round(s, 6), "params_per_s": rate, "per_core": rate / args.threads})
        print(f"{n:12,d} {s:9.4f} {rate:12.3g} {rate / args.threads:12.3g}")
    print(f"median per core: {statistics.median(r['per_core'] for r in rows):.3g} params/s")
    if args.json:
        with open(args.json, "w") as f:
            doc = {"threads": args.threads, "cpu": _cpu_name(), "rows": rows}
            json.dump(doc, f, indent=1)
    return 0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


if __name__ == "__main__":
    sys.exit(main())
