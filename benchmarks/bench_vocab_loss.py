"""Full vs chunked vocabulary loss on the CPU: peak bytes and step time, SFT and DPO.

A 2-layer Llama-style model with Qwen2's 151,936-token vocabulary (built from a config, random
init, no download) runs one training step (forward, loss, backward) per setting; peaks are live
tensor bytes above the weights (memfit.memory.AllocationTracker), times the median of 3 steps
after a warm-up. For SFT, PyTorch's own `torch.nn.functional.linear_cross_entropy` (2.13, with
its chunked `LinearCrossEntropyOptions`) runs as a third column. Everything is measured in this
run; ratios are against the full path of the same run.

    python benchmarks/bench_vocab_loss.py                   # 2,048 and 4,096 tokens (~2 min, ~9 GiB RAM)
    python benchmarks/bench_vocab_loss.py --tokens 8192     # ~17 GiB RAM for the full path
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from memfit.memory import AllocationTracker
from memfit.steps import StepRunner
from memfit.units import fmt_bytes

VOCAB = 151_936  # Qwen2/2.5 (config/models.yaml)


def build(hidden: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16384,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).float().train()


def step(model, impl: str, method: str, ids: torch.Tensor) -> None:
    labels = ids.clone()
    if impl == "torch-lce":  # SFT only: PyTorch's fused linear cross entropy on the final hidden states
        hidden = model.model(input_ids=ids).last_hidden_state
        loss = F.linear_cross_entropy(hidden[:, :-1].reshape(-1, hidden.shape[-1]), model.lm_head.weight,
                                      labels[:, 1:].reshape(-1), options=torch.nn.LinearCrossEntropyOptions())
    else:
        runner = StepRunner(method, model, None, 0, loss_impl=impl)
        logps, mask = runner.token_logps(model, labels, input_ids=ids)
        if method == "sft":
            loss = -logps.sum() / mask.sum()
        else:  # DPO: chosen rows first, rejected second (precomputed reference: zero log-ratio base)
            seq = logps.sum(-1)
            n = len(seq) // 2
            loss = -F.logsigmoid(0.1 * (seq[:n] - seq[n:])).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)


def measure(model, impl: str, method: str, tokens: int) -> tuple[int, float]:
    rows = 2 if method == "dpo" else 1
    ids = torch.randint(0, VOCAB, (rows, tokens // rows), generator=torch.Generator().manual_seed(1))
    step(model, impl, method, ids)  # warm-up
    with AllocationTracker("cpu") as tracker:
        step(model, impl, method, ids)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        step(model, impl, method, ids)
        times.append(time.perf_counter() - t0)
    return tracker.peak_bytes - tracker.baseline_bytes, statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--hidden", type=int, default=256)
    args = p.parse_args(argv)
    model = build(args.hidden)
    print(f"model: 2 layers, hidden {args.hidden}, vocab {VOCAB:,}, fp32, {torch.get_num_threads()} threads")
    print(f"{'method':6} {'tokens':>6} {'impl':>9} {'peak':>11} {'step':>8}  peak/full  time/full")
    for method in ("sft", "dpo"):
        for tokens in args.tokens:
            base = None
            for impl in ("full", "chunked") + (("torch-lce",) if method == "sft" else ()):
                peak, secs = measure(model, impl, method, tokens)
                base = base or (peak, secs)
                print(f"{method:6} {tokens:>6} {impl:>9} {fmt_bytes(peak):>11} {secs:>7.2f}s"
                      f"  {peak / base[0]:9.3f}  {secs / base[1]:9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
