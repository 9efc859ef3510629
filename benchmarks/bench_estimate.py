"""How fast `estimate_space` ranks a GPU search space for a 72B model (target: < 5 s).

    .venv/bin/python benchmarks/bench_estimate.py [--model qwen2.5-72b] [--gpu a100-80gb]

The estimator is analytic (no traced run), so there is no first-trace cost to report; the
first call pays only the catalog load and the per-architecture caches (`param_layout`,
`zero3_subgroups`), printed separately.
"""

from __future__ import annotations

import argparse
import time

from memfit import catalog
from memfit.estimate import estimate_space
from memfit.space import enumerate_space

# Every knob that changes memory on a GPU cluster, at the values users try.
AXES = {
    "zero": [1, 2, 3],
    "offload_optimizer": ["none", "cpu"],
    "offload_param": ["none", "cpu"],
    "pin_memory": [False, True],
    "offload_ratio": [1.0, 0.5],
    "grad_ckpt": [False, True],
    "attn": ["flash", "sdpa", "eager"],
    "finetune": ["full", "lora", "qlora"],
    "micro_batch": [1, 2, 4, 8],
    "seq_len": [1024, 2048, 4096, 8192],
    "precision": ["bf16"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-72b")
    ap.add_argument("--gpu", default="a100-80gb")
    ap.add_argument("--num-gpus", type=int, default=8)
    ap.add_argument("--num-nodes", type=int, default=4)
    ap.add_argument("--method", default="dpo")
    args = ap.parse_args()

    t0 = time.perf_counter()
    arch, gpu = catalog.model(args.model), catalog.gpu(args.gpu)
    cands = list(enumerate_space(AXES, {"ref": "model" if args.method == "dpo" else "precomputed"}))
    t1 = time.perf_counter()
    first = estimate_space(arch, gpu, args.num_gpus, args.num_nodes, args.method, cands[:1])
    t2 = time.perf_counter()
    rows = estimate_space(arch, gpu, args.num_gpus, args.num_nodes, args.method, cands)
    t3 = time.perf_counter()
    fits = sum(r["fits"] for r in rows if not r["invalid"])
    print(
        f"model {args.model} ({first[0]['params_total'] / 1e9:.1f} B params), {args.num_nodes}x"
        f"{args.num_gpus} {args.gpu}, {args.method}"
    )
    print(f"catalog load + enumerate {len(cands)} candidates: {t1 - t0:.3f} s")
    print(f"first estimate (cold caches, no traced path): {(t2 - t1) * 1e3:.1f} ms")
    print(
        f"whole space: {len(rows)} estimates in {t3 - t2:.3f} s "
        f"({len(rows) / (t3 - t2):,.0f} estimates/s), {fits} fit"
    )
    best = max((r for r in rows if r["fits"]), key=lambda r: r["tokens_per_s"], default=None)
    if best:
        print(
            f"highest predicted throughput that fits: {best['id']}  "
            f"{best['tokens_per_s']:,.0f} tokens/s, "
            f"{best['device_total_bytes'] / 2**30:.1f} GiB per GPU"
        )


if __name__ == "__main__":
    main()
