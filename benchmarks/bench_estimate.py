"""How fast `estimate_space` ranks a GPU search space for a 72B model (target: < 5 s), with the
analytic activations and with traced ones (first trace of a new architecture: target < 60 s).

    .venv/bin/python benchmarks/bench_estimate.py [--model qwen2.5-72b] [--gpu a100-80gb]
        [--trace-cache DIR]   # default: a fresh temporary directory, so the traces are new

Figures printed, in order: the analytic space (cold caches, then the whole space); the first
trace of the architecture (one shape: the child process start, 1- and 2-layer fake runs); every
shape the space needs traced (one child process); the whole space again with every trace cached
(read from the JSON files, the in-process copies dropped first) and its ratio to the analytic
run.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

from memfit.estimate import DEFAULT_SETTINGS, estimate_space, prefetch_traces
from memfit.estimate.models import catalog
from memfit.estimate.trace import trace
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
    ap.add_argument("--trace-cache", default=None, help="default: a fresh temporary directory")
    args = ap.parse_args()

    t0 = time.perf_counter()
    arch, gpu = catalog.model(args.model), catalog.gpu(args.gpu)
    cands = list(enumerate_space(AXES, {"ref": "model" if args.method == "dpo" else "precomputed"}))
    t1 = time.perf_counter()
    run = (arch, gpu, args.num_gpus, args.num_nodes, args.method)
    first = estimate_space(*run, cands[:1])
    t2 = time.perf_counter()
    rows = estimate_space(*run, cands)
    t3 = time.perf_counter()
    analytic_s = t3 - t2
    fits = sum(r["fits"] for r in rows if not r["invalid"])
    print(
        f"model {args.model} ({first[0]['params_total'] / 1e9:.1f} B params), {args.num_nodes}x"
        f"{args.num_gpus} {args.gpu}, {args.method}"
    )
    print(f"catalog load + enumerate {len(cands)} candidates: {t1 - t0:.3f} s")
    print(f"analytic: first estimate (cold caches) {(t2 - t1) * 1e3:.1f} ms")
    print(
        f"analytic: whole space {len(rows)} estimates in {analytic_s:.3f} s "
        f"({len(rows) / analytic_s:,.0f} estimates/s), {fits} fit"
    )

    tmp = None
    cache = args.trace_cache
    if cache is None:
        tmp = tempfile.TemporaryDirectory(prefix="memfit-traces-")
        cache = tmp.name
    settings = dataclasses.replace(DEFAULT_SETTINGS, activations="traced", trace_cache=cache)
    c0 = cands[0]
    t4 = time.perf_counter()
    one = trace.layer_trace(
        arch,
        c0.seq_len,
        c0.attn,
        c0.precision,
        c0.grad_ckpt,
        c0.finetune,
        c0.lora_rank,
        cache_dir=cache,
    )
    t5 = time.perf_counter()
    print(
        f"traced: first trace of {args.model} (s={c0.seq_len} {one.key['attn']} "
        f"{'ckpt' if c0.grad_ckpt else 'no-ckpt'} {c0.finetune}, 1 and 2 layers, child process): "
        f"{t5 - t4:.1f} s ({one.seconds:.1f} s tracing)"
    )
    prefetch_traces(arch, gpu, cands, settings)
    t6 = time.perf_counter()
    n_files = len(list(Path(cache).glob("*.json")))
    print(
        f"traced: every shape the space needs ({n_files} traces, {trace.trace_workers()} child processes): {t6 - t5:.1f} s"
    )
    trace.clear_memo()
    t7 = time.perf_counter()
    trows = estimate_space(*run, cands, settings=settings)
    t8 = time.perf_counter()
    traced_s = t8 - t7
    tfits = sum(r["fits"] for r in trows if not r["invalid"])
    print(
        f"traced: whole space, traces cached: {len(trows)} estimates in {traced_s:.3f} s "
        f"({traced_s / analytic_s:.2f}x the analytic run), {tfits} fit"
    )
    diff = [
        (r["id"], a["fits"], r["fits"])
        for a, r in zip(rows, trows, strict=True)
        if not r["invalid"] and a["fits"] != r["fits"]
    ]
    print(f"verdicts that differ between analytic and traced: {len(diff)}")
    best = max((r for r in trows if r["fits"]), key=lambda r: r["tokens_per_s"], default=None)
    if best:
        print(
            f"highest predicted throughput that fits (traced): {best['id']}  "
            f"{best['tokens_per_s']:,.0f} tokens/s, "
            f"{best['device_total_bytes'] / 2**30:.1f} GiB per GPU"
        )
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
