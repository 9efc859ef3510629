"""Full vs chunked vocabulary loss on the CPU: peak bytes and time of the loss stage, SFT and DPO.

The loss stage is what `loss_impl` changes: the final hidden states (requiring grad) through the LM
head (Qwen2's 151,936-token vocabulary, hidden 256, a 2-layer Llama-style model built from a
config, random init, no download) to the SFT loss or the DPO loss, and its backward to the hidden
states and the head. Peaks are live tensor bytes above what exists before the stage (the weights
and the hidden states; memfit.train.memory.AllocationTracker), times the median of 3 runs after a
warm-up. For SFT, PyTorch's own `torch.nn.functional.linear_cross_entropy` (2.13, with its chunked
`LinearCrossEntropyOptions`) runs as a third row. Everything is measured in this run; ratios are
against the full path of the same run.

    python benchmarks/bench_vocab_loss.py                   # 2,048 and 4,096 tokens (full needs ~9.3 GiB at 4,096)
    python benchmarks/bench_vocab_loss.py --tokens 8192     # full needs ~19 GiB: a machine to itself
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from memfit.train.memory import AllocationTracker
from memfit.train.steps import StepRunner
from memfit.units import fmt_bytes

VOCAB = 151_936  # Qwen2/2.5 (config/models.yaml)


def build(hidden: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=16384,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).float().train()


class _HeadOnly(torch.nn.Module):
    """The model from its final hidden states on: its own lm_head (what ChunkedHead patches)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model, self.lm_head = model, model.lm_head

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, hidden):
        return type("Out", (), {"logits": self.lm_head(hidden)})()


def step(model, impl: str, method: str, hidden: torch.Tensor, ids: torch.Tensor) -> None:
    labels = ids.clone()
    head = _HeadOnly(model)
    if impl == "torch-lce":  # SFT only: PyTorch's fused linear cross entropy on the final hidden states
        loss = F.linear_cross_entropy(
            hidden[:, :-1].reshape(-1, hidden.shape[-1]),
            model.lm_head.weight,
            labels[:, 1:].reshape(-1),
            options=torch.nn.LinearCrossEntropyOptions(),
        )
    else:
        runner = StepRunner(method, head, None, 0, loss_impl=impl)
        logps, mask = runner.token_logps(head, labels, hidden=hidden)
        if method == "sft":
            loss = -logps.sum() / mask.sum()
        else:  # DPO: chosen rows first, rejected second (precomputed reference: zero log-ratio base)
            seq = logps.sum(-1)
            n = len(seq) // 2
            loss = -F.logsigmoid(0.1 * (seq[:n] - seq[n:])).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    hidden.grad = None


def measure(model, impl: str, method: str, tokens: int) -> tuple[int, float]:
    rows = 2 if method == "dpo" else 1
    ids = torch.randint(0, VOCAB, (rows, tokens // rows), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
    hidden.requires_grad_(True)
    step(model, impl, method, hidden, ids)  # warm-up
    with AllocationTracker("cpu") as tracker:
        step(model, impl, method, hidden, ids)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        step(model, impl, method, hidden, ids)
        times.append(time.perf_counter() - t0)
    return tracker.peak_bytes - tracker.baseline_bytes, statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--hidden", type=int, default=256)
    args = p.parse_args(argv)
    model = build(args.hidden)
    print(f"model: 2 layers, hidden {args.hidden}, vocab {VOCAB:,}, fp32, {torch.get_num_threads()} threads")
    print(f"{'method':6} {'tokens':>6} {'impl':>9} {'loss peak':>11} {'time':>8}  peak/full  time/full")
    for method in ("sft", "dpo"):
        for tokens in args.tokens:
            base = None
            for impl in ("full", "chunked") + (("torch-lce",) if method == "sft" else ()):
                peak, secs = measure(model, impl, method, tokens)
                base = base or (peak, secs)
                print(
                    f"{method:6} {tokens:>6} {impl:>9} {fmt_bytes(peak):>11} {secs:>7.2f}s"
                    f"  {peak / base[0]:9.3f}  {secs / base[1]:9.2f}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
