"""Padding-free batches' tokens/s gain against the padding they remove: memfit's own step on the CPU
over length distributions with a controlled padding share (issue #45).

The bar: "the demo's tokens/s rises by the share of padding it removed". A padded batch of rows
with padding share p (of the tokens it computes, the share that is padding) computes 1/(1-p) x the
tokens of its rows; a padding-free step that cost only its rows' tokens would run 1/(1-p) x the
padded step's non-padding tokens/s: the ideal gain. This script measures the real gain.

The step: memfit.train.steps.StepRunner.loss (padded: memfit.train.batches.collate, right
padding with an attention mask; padding-free: padding_free_batch / dpo_padding_free_batch, one
row, position ids restarting per sequence, memfit's per-sequence sdpa: memfit.train.varlen_attention), then
backward and DeepSpeed's FusedAdam step (benchmarks/bench_dpo_vs_trl.py `fused_adamw`, the
optimizer memfit's DeepSpeed config builds), on the plain torch model, as
benchmarks/bench_trainer_speed.py drives it. The demo model (config/models/demo-tiny.json, built by
memfit.workflow.demo: 4 layers, hidden 256, 4 heads of 64, 2 KV heads), fp32, sdpa, 1 process,
--threads torch threads (1). DPO: sigmoid loss, beta 0.1, the reference a second frozen copy
(full) or the adapter-disabled policy (LoRA: peft r=8, alpha=16, all linear layers).

Cases (each a set of rows; batch --batch rows or pairs):
- demo: the demo's own rows (data/demo/{sft,dpo}.jsonl prepared by memfit.data.prepare at 64 tokens);
- uL/4, uL/2: synthetic rows whose sequence lengths are uniform in [L/4, L] or [L/2, L], for L in
  --lengths (32, 128, 512); SFT: the first quarter of a row is the prompt (not scored); DPO: a
  pair's chosen and rejected sequences drawn apart, their shared prompt a quarter of the shorter;
- heavy: lengths log-normal (median 48, sigma 1; Limpert et al. 2001 for the shape, chosen here to
  be heavy-tailed, not fitted to a data set) clipped to [8, 512]: a few long rows pad many short ones.
The demo model has max_position_embeddings 128; RoPE computes its angles from the position ids
(transformers LlamaRotaryEmbedding), so rows to 512 run, with positions the model never trained on
(random init anyway: speed, not quality).

Per case: --batches fixed batches drawn from the rows; padded and padding-free steps alternate on
the same batch, the order flipping every step (ABBA), so load from other jobs on the machine
falls on both; the same model and optimizer run both (only the StepRunner differs). One warm-up
step of each first; then whole passes over the batches until each side ran --min-steps and the
case used --case-seconds, or --max-steps (so p is that of the same batches in every run). Per side: non-padding tokens/s = the sequences' own tokens over the summed step
seconds. p = the padding share of the measured padded batches (padding tokens over all tokens
they computed), ideal = 1/(1-p), gain = padding-free tokens/s over padded tokens/s, and
gain/ideal. The machine's load average (os.getloadavg) is recorded before and after each case.

Output: a table on stdout and benchmarks/results/padding_free_cpu.json (--out).

Usage: .venv/bin/python benchmarks/bench_padding_free.py               # SFT and DPO, full, ~5 minutes on 2 cores
       .venv/bin/python benchmarks/bench_padding_free.py --finetunes full,lora --cases demo,u128/4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_dpo_vs_trl beside this file

import torch  # noqa: E402
from bench_dpo_vs_trl import REPO, fused_adamw, load_model  # noqa: E402

IGNORE = -100


def case_names(lengths: list[int]) -> list[str]:
    return ["demo"] + [f"u{n}/{d}" for n in lengths for d in (4, 2)] + ["heavy"]


def draw_lengths(case: str, n: int, rng: random.Random) -> list[int]:
    """`n` sequence lengths of a synthetic case (module docstring)."""
    if case == "heavy":
        return [min(512, max(8, round(rng.lognormvariate(0.0, 1.0) * 48))) for _ in range(n)]
    top, div = (int(x) for x in case[1:].split("/"))
    return [rng.randint(top // div, top) for _ in range(n)]


def synthetic_rows(method: str, case: str, n: int, vocab: int, seed: int) -> list[dict]:
    """`n` rows (SFT) or pairs (DPO) of random token ids (3..vocab: no pad/bos/eos) of the case's lengths."""
    rng = random.Random(f"{seed}-{method}-{case}")

    def ids(k: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(k)]

    if method == "sft":
        rows = []
        for length in draw_lengths(case, n, rng):
            x, prompt = ids(length), length // 4
            rows.append({"input_ids": x, "labels": [IGNORE] * prompt + x[prompt:]})
        return rows
    chosen, rejected = draw_lengths(case, n, rng), draw_lengths(case, n, rng)
    out = []
    for c, r in zip(chosen, rejected, strict=True):
        prompt = min(c, r) // 4
        out.append({"prompt_ids": ids(prompt), "chosen_ids": ids(c - prompt), "rejected_ids": ids(r - prompt)})
    return out


def seq_lengths(method: str, batch: list[dict]) -> list[int]:
    """The sequences one step computes: SFT the rows, DPO chosen then rejected of every pair."""
    if method == "sft":
        return [len(r["input_ids"]) for r in batch]
    return [len(r["prompt_ids"]) + len(r[k]) for k in ("chosen_ids", "rejected_ids") for r in batch]


class Trainer:
    """The demo model, its optimizer and a padded and a padding-free StepRunner over the same weights."""

    def __init__(self, model_dir: Path, pad_id: int, method: str, finetune: str, a) -> None:
        from memfit.train import varlen_attention
        from memfit.train.steps import StepRunner

        # memfit's per-sequence sdpa, as the trainer loads a padding_free sdpa candidate
        # (memfit.train.modeling.attn_implementation); a padded batch, carrying its 2-D mask, runs
        # transformers' own sdpa on it (tests/test_varlen_attention.py), so both sides share weights
        attn = varlen_attention.register()

        torch.manual_seed(a.seed)
        self.policy, ref, ref_mode = load_model(model_dir, attn), None, "model"
        if method == "dpo" and finetune == "full":
            ref = load_model(model_dir, attn).eval().requires_grad_(False)
        if finetune == "lora":
            from bench_trainer_speed import lora_config
            from peft import get_peft_model

            self.policy, ref_mode = get_peft_model(self.policy, lora_config()), "adapter"
        self.policy.train()
        self.opt = fused_adamw([p for p in self.policy.parameters() if p.requires_grad], a.lr)
        dpo = {"beta": 0.1, "loss_type": "sigmoid", "label_smoothing": 0.0} if method == "dpo" else None
        self.runners = {
            pf: StepRunner(method, self.policy, ref, pad_id, dpo=dpo, ref=ref_mode, padding_free=pf)
            for pf in (False, True)
        }

    def step(self, batch: list[dict], padding_free: bool) -> tuple[float, int]:
        """Seconds of one training step (loss, backward, optimizer) and its non-padding tokens."""
        t0 = time.perf_counter()
        loss, _, tokens = self.runners[padding_free].loss(batch)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return time.perf_counter() - t0, tokens


def run_case(trainer: Trainer, method: str, rows: list[dict], a, rng: random.Random) -> dict:
    batches = [rng.sample(rows, a.batch) for _ in range(a.batches)]
    for pf in (False, True):  # warm-up: a new shape (allocator, transformers' mask path)
        trainer.step(batches[0], pf)
    secs = {False: 0.0, True: 0.0}
    toks = {False: 0, True: 0}
    pad = total = steps = 0
    t_case = time.perf_counter()
    while steps < a.max_steps and (
        steps < a.min_steps or steps % len(batches) or time.perf_counter() - t_case < a.case_seconds
    ):  # whole passes over the batches (an even number): every batch as often, as many of each order
        b = batches[steps % len(batches)]
        for pf in (False, True) if steps % 2 == 0 else (True, False):  # ABBA
            dt, tokens = trainer.step(b, pf)
            secs[pf] += dt
            toks[pf] += tokens
        lengths = seq_lengths(method, b)
        total += len(lengths) * max(lengths)
        pad += len(lengths) * max(lengths) - sum(lengths)
        steps += 1
    assert toks[False] == toks[True], (toks, "both sides must compute the same sequences")
    p = pad / total
    padded, free = toks[False] / secs[False], toks[True] / secs[True]
    gain, ideal = free / padded, 1.0 / (1.0 - p)
    return {
        "steps": steps,
        "padding_share": round(p, 4),
        "mean_seq_tokens": round(toks[False] / steps / len(seq_lengths(method, batches[0])), 1),
        "padded_step_s": round(secs[False] / steps, 5),
        "padding_free_step_s": round(secs[True] / steps, 5),
        "padded_tokens_per_s": round(padded, 1),
        "padding_free_tokens_per_s": round(free, 1),
        "gain": round(gain, 3),
        "ideal_gain": round(ideal, 3),
        "gain_over_ideal": round(gain / ideal, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="sft,dpo")
    p.add_argument("--finetunes", default="full", help="full and/or lora (LoRA roughly doubles the run)")
    p.add_argument("--lengths", default="32,128,512", help="L of the uniform cases uL/4 and uL/2")
    p.add_argument("--cases", default=None, help="a subset of the cases, comma-separated (default: all)")
    p.add_argument("--batch", type=int, default=8, help="rows (SFT) or pairs (DPO) per step")
    p.add_argument("--batches", type=int, default=4, help="distinct batches drawn per case (cycled; even)")
    p.add_argument("--rows", type=int, default=256, help="rows drawn from per case")
    p.add_argument("--min-steps", type=int, default=4, help="steps of each side per case, at least")
    p.add_argument("--max-steps", type=int, default=32, help="steps of each side per case, at most")
    p.add_argument("--case-seconds", type=float, default=5.0, help="time per case past which no step starts")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/padding_free_cpu.json")
    a = p.parse_args()
    methods, finetunes = a.methods.split(","), a.finetunes.split(",")
    all_cases = case_names([int(x) for x in a.lengths.split(",")])
    cases = a.cases.split(",") if a.cases else all_cases
    bad = [m for m in methods if m not in ("sft", "dpo")] + [f for f in finetunes if f not in ("full", "lora")]
    bad += [c for c in cases if c not in all_cases]
    if bad:
        p.error(f"unknown --methods/--finetunes/--cases value(s) {bad} (cases: {', '.join(all_cases)})")
    if a.batch < 2 or a.batches < 2 or a.batches % 2 or a.min_steps < 1 or a.max_steps % a.batches:
        p.error("--batch must be >= 2, --batches even, --min-steps >= 1 and --max-steps a multiple of --batches")
    if a.threads > 0:
        torch.set_num_threads(a.threads)

    from transformers import AutoTokenizer

    from memfit import data
    from memfit.workflow.demo import build_demo_model

    results = []
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = tmp / "demo-tiny"
        build_demo_model(REPO / "config/models/demo-tiny.json", REPO / "data/demo", model_dir)
        tok = AutoTokenizer.from_pretrained(model_dir)
        for m in methods:
            demo_rows = None
            if "demo" in cases:
                data.prepare(m, REPO / f"data/demo/{m}.jsonl", model_dir, tmp / m, max_len=64, eval_fraction=0.05)
                demo_rows = data.load_split(tmp / m, "train")[: a.rows]
            for f in finetunes:
                trainer = Trainer(model_dir, tok.pad_token_id, m, f, a)
                for c in cases:
                    rows = demo_rows if c == "demo" else synthetic_rows(m, c, a.rows, len(tok), a.seed)
                    before = os.getloadavg()
                    r = run_case(trainer, m, rows, a, random.Random(f"{a.seed}-{m}-{c}-batches"))
                    r = {"method": m, "finetune": f, "case": c} | r
                    r["load_average"] = [before[0], os.getloadavg()[0]]
                    results.append(r)
                    print(
                        f"{m} {f} {c}: p {r['padding_share']:.1%}, {r['padded_tokens_per_s']:.0f} -> "
                        f"{r['padding_free_tokens_per_s']:.0f} tok/s, gain {r['gain']:.2f}x of ideal "
                        f"{r['ideal_gain']:.2f}x ({r['steps']} steps each, load {r['load_average'][0]:.1f})",
                        flush=True,
                    )
    wall = time.perf_counter() - t_start
    print(
        f"\nbatch {a.batch}, fp32, sdpa, 1 process, torch threads {torch.get_num_threads()}, "
        f"{wall:.0f} s; p: padding share of the padded batch; tokens/s: the sequences' own tokens"
    )
    head = f"{'method':6} {'tune':4} {'case':7} {'seq':>6} {'p':>6} {'padded':>8} {'pad-free':>8}"
    print(head + f" {'gain':>6} {'ideal':>6} {'gain/ideal':>10}")
    for r in results:
        print(
            f"{r['method']:6} {r['finetune']:4} {r['case']:7} {r['mean_seq_tokens']:>6.1f} "
            f"{r['padding_share']:>6.1%} {r['padded_tokens_per_s']:>8.0f} {r['padding_free_tokens_per_s']:>8.0f} "
            f"{r['gain']:>6.2f} {r['ideal_gain']:>6.2f} {r['gain_over_ideal']:>10.2f}"
        )
    import transformers

    report = {
        "settings": vars(a) | {"out": str(a.out), "torch_threads": torch.get_num_threads(), "wall_s": round(wall)},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "results": results,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
