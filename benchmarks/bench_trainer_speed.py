"""Trainer speed side by side: memfit's SFT and DPO step against TRL's SFTTrainer and DPOTrainer, same
model, data, sequence length, precision and machine, full fine-tuning and LoRA, in one run (issue #45).

Both sides train the embedded demo model (config/models/demo-tiny.json, built by
memfit.workflow.demo) from the same initial weights on the demo data (data/demo/sft.jsonl,
data/demo/dpo.jsonl) prepared by memfit.data.prepare at --max-len tokens. SFT: TRL gets memfit's
tokenized rows (input_ids, completion_mask = memfit's response labels), so both train on the same
tokens and score the same ones. DPO: the settings and pieces of benchmarks/bench_dpo_vs_trl.py
(imported from it: its TRL config, timing callback, memfit step loop). fp32, sdpa attention, each side's
default fused AdamW (TRL: adamw_torch_fused; memfit: DeepSpeed's FusedAdam),
constant LR, no clipping, no gradient checkpointing, 1 process, --threads torch threads, batch --batch rows (SFT) or pairs (DPO).
LoRA: peft r=8, alpha=16 on all linear layers, on both sides; DPO's reference then is the
adapter-disabled policy on both sides (TRL's ref_model=None with peft, memfit's ref: adapter).

Variants per (method, finetune), run in alternating rounds (TRL, memfit, memfit levers, TRL, ...) so
other load on the machine spreads over all of them:
- trl: the trainer as configured above; trl+padding_free: TRL's padding_free=True (SFTConfig,
  DPOConfig: one row of concatenated sequences with position_ids; transformers masks it
  block-causally under sdpa);
  trl+compile: TrainingArguments.torch_compile=True (the whole model through torch.compile; the steps
  that compiled a graph are not measured, as for memfit+compile);
  TRL's use_liger_kernel is reported as skipped unless the liger-kernel package and a CUDA GPU exist
  (its Triton kernels need CUDA);
- memfit: memfit.train.steps.StepRunner + backward + DeepSpeed's FusedAdam step (no DeepSpeed engine: the step itself);
  memfit+compile: regional torch.compile of the decoder layers (memfit.train.compile, RunConfig.compile);
  the steps that compiled a graph (the first, a new batch length, a batch without padding) are not
  measured but summed as compile_s, and the run goes on until --steps steps compiled nothing;
  memfit+padding_free: RunConfig.padding_free (SFT and DPO).

The padding share per method (of the tokens a padded batch of --batch rows or pairs computes, the
share that is padding: mean over 1,000 batches drawn from the same rows) is printed beside the table:
padding-free's tokens/s gain over the padded step is what that share predicts at most.

Reported per variant, best round: steps/s; non-padding tokens/s = steps/s x batch x the mean
non-padding tokens of a training unit (a row for SFT; a pair's chosen + rejected sequences for DPO) over the rows
sampled (both sides draw uniformly from the same rows); MFU = model FLOP/s over the measured fp32
matmul rate of this CPU (a 2048^3 torch.mm at the same thread count: the CPU's practical dense peak,
not a datasheet number). Model FLOPs per token (Kaplan et al. 2020, arXiv:2001.08361, Sec. 2.1; PaLM,
Chowdhery et al. 2022, arXiv:2204.02311, App. B, with the attention term 12 * layers * hidden * T for a
sequence of T tokens): full training 6N + 12 L d T, LoRA 4N + 8 L d T (no weight gradients of frozen
weights: forward 2, backward to the activations 2; the adapters' FLOPs are below 1% at r=8), and
DPO adds the reference's forward 2N + 4 L d T per token. N: every matmul weight incl. the (tied) head.
The machine's load average (os.getloadavg) is recorded before and after each round.

Output: a table on stdout and benchmarks/results/trainer_speed_cpu.json (--out).

Usage: .venv/bin/python benchmarks/bench_trainer_speed.py [--steps 20 --warmup 5 --rounds 2 --batch 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_dpo_vs_trl beside this file

import torch  # noqa: E402
from bench_dpo_vs_trl import REPO, load_model, run_memfit, run_trl, timed_train, trl_args  # noqa: E402


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def liger_status() -> str | None:
    """None when TRL's use_liger_kernel can run here, else why not."""
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return "skipped: the liger-kernel package is not installed"
    if not torch.cuda.is_available():
        return "skipped: liger-kernel's Triton kernels need a CUDA GPU, this run has none"
    return None


def run_trl_sft(model_dir: Path, rows: list[dict], a, out: Path, peft_config=None, **extra) -> dict:
    """TRL's SFTTrainer on memfit's tokenized rows (TRL skips tokenizing a dataset with input_ids)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(a.seed)
    ds = Dataset.from_list(
        [{"input_ids": r["input_ids"], "completion_mask": [int(y != -100) for y in r["labels"]]} for r in rows]
    )
    args = trl_args(SFTConfig, a, out, max_length=None, completion_only_loss=True, **extra)
    return timed_train(
        SFTTrainer,
        a,
        model=load_model(model_dir),
        args=args,
        train_dataset=ds,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        peft_config=peft_config,
    )


def matmul_peak(n: int = 2048, reps: int = 5) -> float:
    """FLOP/s of the best of `reps` fp32 n x n x n torch.mm on this CPU (2 n^3 FLOPs each)."""
    x, y = torch.randn(n, n), torch.randn(n, n)
    torch.mm(x, y)
    best = min(_timed(lambda: torch.mm(x, y)) for _ in range(reps))
    return 2 * n**3 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def flops_per_token(model_dir: Path, finetune: str, method: str, seq: float) -> float:
    """Model FLOPs per trained token (see the module docstring for the formula and its sources)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    d, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    model = load_model(model_dir)
    n = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2)  # matmul weights; head tied
    attn = layers * d * seq
    f = 6 * n + 12 * attn if finetune == "full" else 4 * n + 8 * attn
    return f + (2 * n + 4 * attn if method == "dpo" else 0)


def variants(method: str) -> list[tuple[str, dict]]:
    """(name, options) of each side run for `method`."""
    return [
        ("trl", {}),
        ("trl+padding_free", {"padding_free": True}),
        ("trl+compile", {"torch_compile": True}),
        ("memfit", {}),
        ("memfit+compile", {"compile": True}),
        ("memfit+padding_free", {"padding_free": True}),
    ]


def padding_share(rows: list[dict], method: str, batch: int, seed: int, draws: int = 1000) -> float:
    """The share of a padded batch's tokens that are padding (`collate` pads each batch to its
    longest sequence; DPO: the 2 x batch chosen and rejected sequences), over `draws` random batches."""
    import random

    rng = random.Random(seed)
    pad = total = 0
    for _ in range(draws):
        picked = rng.sample(rows, batch)
        if method == "sft":
            lengths = [len(r["input_ids"]) for r in picked]
        else:
            lengths = [len(r["prompt_ids"]) + len(r[k]) for k in ("chosen_ids", "rejected_ids") for r in picked]
        total += len(lengths) * max(lengths)
        pad += len(lengths) * max(lengths) - sum(lengths)
    return pad / total


def run_one(name: str, opts: dict, method: str, finetune: str, ctx: dict, a, out: Path) -> dict:
    # each variant compiles from nothing, as a training process does: the variants before it in this
    # process left compiled code for the same layer code and counted against its recompile limit
    # (torch._dynamo.config.recompile_limit), past which dynamo runs the layer eagerly
    torch._dynamo.reset()
    peft = lora_config() if finetune == "lora" else None
    rows, model_dir, pad_id = ctx["rows"][method], ctx["model_dir"], ctx["pad_id"]
    if name.startswith("trl"):
        if opts.get("torch_compile"):  # room for the steps that compile (not measured: timed_train)
            opts = opts | {"max_steps": a.warmup + 3 * a.steps}
        if method == "sft":
            return run_trl_sft(model_dir, rows, a, out, peft, **opts)
        return run_trl(model_dir, ctx["records"], a, out, peft, **opts)
    return run_memfit(model_dir, rows, a, pad_id, method, peft, **opts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="measured steps (after warm-up)")
    p.add_argument("--warmup", type=int, default=5, help="steps before the clock starts (compile happens here)")
    p.add_argument("--batch", type=int, default=8, help="rows (SFT) or pairs (DPO) per step")
    p.add_argument("--max-len", type=int, default=64, help="data.max_len: tokens per row (prompt + response)")
    p.add_argument("--rows", type=int, default=256, help="training rows drawn from")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--methods", default="sft,dpo")
    p.add_argument("--finetunes", default="full,lora")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads, both sides (0: torch's default). 1 by default: on a small shared machine "
        "(2 cores, other jobs) several intra-op threads slow down by 10x and more when a core is taken",
    )
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/trainer_speed_cpu.json")
    a = p.parse_args()
    if a.warmup < 1 or a.steps < 1 or a.rounds < 1:
        p.error("--warmup, --steps and --rounds must be >= 1")
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    methods, finetunes = a.methods.split(","), a.finetunes.split(",")
    if bad := [m for m in methods if m not in ("sft", "dpo")] + [f for f in finetunes if f not in ("full", "lora")]:
        p.error(f"unknown --methods/--finetunes value(s) {bad} (methods: sft, dpo; finetunes: full, lora)")

    from transformers import AutoTokenizer

    from memfit import data
    from memfit.workflow.demo import build_demo_model

    results: dict[str, list[dict]] = {}
    loads: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = tmp / "demo-tiny"
        build_demo_model(REPO / "config/models/demo-tiny.json", REPO / "data/demo", model_dir)
        ctx: dict = {
            "model_dir": model_dir,
            "rows": {},
            "pad_id": AutoTokenizer.from_pretrained(model_dir).pad_token_id,
        }
        tokens: dict[str, float] = {}
        ctx_rows: dict[str, list[dict]] = {}
        for m in methods:
            data.prepare(m, REPO / f"data/demo/{m}.jsonl", model_dir, tmp / m, max_len=a.max_len, eval_fraction=0.05)
            rows = data.load_split(tmp / m, "train")[: a.rows]
            ctx["rows"][m] = rows
            ctx_rows[m] = rows
            if m == "sft":
                tokens[m] = statistics.mean(len(r["input_ids"]) for r in rows)
            else:
                tokens[m] = statistics.mean(
                    2 * len(r["prompt_ids"]) + len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in rows
                )
                lines = (REPO / "data/demo/dpo.jsonl").read_text().splitlines()
                ctx["records"] = [json.loads(lines[r["row"] - 1]) for r in rows]
        peak = matmul_peak()
        seq = {m: tokens[m] / (2 if m == "dpo" else 1) for m in methods}  # mean sequence length
        fpt = {(m, f): flops_per_token(model_dir, f, m, seq[m]) for m in methods for f in finetunes}
        for k in range(a.rounds):
            load = {"round": k, "before": os.getloadavg()}
            for m in methods:
                for f in finetunes:
                    for name, opts in variants(m):
                        key = f"{m}/{f}/{name}"
                        r = run_one(name, opts, m, f, ctx, a, tmp / f"{key.replace('/', '_')}{k}")
                        r["tokens_per_s"] = r["steps_per_s"] * a.batch * tokens[m]
                        r["mfu"] = r["tokens_per_s"] * fpt[(m, f)] / peak
                        results.setdefault(key, []).append(r)
                        print(
                            f"round {k} {key}: {r['steps_per_s']:.2f} steps/s, {r['tokens_per_s']:.0f} tok/s",
                            flush=True,
                        )
            load["after"] = os.getloadavg()
            loads.append(load)

    best = {k: max(v, key=lambda r: r["steps_per_s"]) for k, v in results.items()}
    table = []
    for m in methods:
        for f in finetunes:
            trl = best[f"{m}/{f}/trl"]
            for name, _ in variants(m):
                b = best[f"{m}/{f}/{name}"]
                table.append(
                    {
                        "method": m,
                        "finetune": f,
                        "variant": name,
                        "tokens_per_s": round(b["tokens_per_s"], 1),
                        "mfu": round(b["mfu"], 5),
                        "vs_trl": round(b["steps_per_s"] / trl["steps_per_s"], 3),
                    }
                )
    print(
        f"\nsettings: batch {a.batch}, max_len {a.max_len}, warmup {a.warmup}, measured steps {a.steps}, "
        f"rounds {a.rounds} (best shown), fp32, sdpa, 1 process, torch threads {torch.get_num_threads()}, "
        f"matmul peak {peak / 1e9:.1f} GFLOP/s; load average per round {[(x['before'][0], x['after'][0]) for x in loads]}"
    )
    print(f"TRL use_liger_kernel: {liger_status() or 'available'}")
    shares = {m: padding_share(ctx_rows[m], m, a.batch, a.seed) for m in methods}
    print("padding share of a padded batch: " + ", ".join(f"{m} {v:.1%}" for m, v in shares.items()))
    print(f"{'method':6} {'finetune':8} {'variant':22} {'tokens/s':>10} {'MFU':>8} {'x TRL':>7}")
    for row in table:
        print(
            f"{row['method']:6} {row['finetune']:8} {row['variant']:22} {row['tokens_per_s']:>10.0f} "
            f"{row['mfu']:>8.2%} {row['vs_trl']:>7.3f}"
        )
    import transformers
    import trl

    report = {
        "settings": vars(a) | {"out": str(a.out), "torch_threads": torch.get_num_threads()},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "matmul_peak_flops": peak,
        "flops_per_token": {f"{m}/{f}": v for (m, f), v in fpt.items()},
        "tokens_per_unit": tokens,
        "padding_share": shares,
        "liger": liger_status() or "available",
        "load_average": loads,
        "best": table,
        "rounds": results,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
