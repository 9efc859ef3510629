"""Trainer speed side by side: memfit's SFT and DPO step against TRL's SFTTrainer and DPOTrainer, same
model, data, sequence length, precision and machine, full fine-tuning and LoRA, in one run (issue #45).

On the CPU (the default) both sides train the embedded demo model (config/models/demo-tiny.json, built by
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
  trl+liger: use_liger_kernel=True, skipped with the reason unless liger-kernel and a CUDA GPU exist
  (its Triton kernels need CUDA);
- memfit: memfit.train.steps.StepRunner + backward + DeepSpeed's FusedAdam step (no DeepSpeed engine: the step itself);
  memfit+compile: regional torch.compile of the decoder layers (memfit.train.compile, RunConfig.compile);
  the steps that compiled a graph (the first, a new batch length, a batch without padding) are not
  measured but summed as compile_s, and the run goes on until --steps steps compiled nothing;
  memfit+padding_free: RunConfig.padding_free (SFT and DPO); memfit+compile+padding_free: both levers;
  memfit+liger: kernels liger (as trl+liger).

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

A CUDA GPU (--device cuda; the default stays cpu, also on a GPU machine, so the committed CPU result
and its command keep their meaning): by default the Llama-3.1-8B shape (--model llama-3.1-8b: memfit's
catalog architecture, config/models.yaml, random weights, no download; benchmarks/trainer_speed_setup.py
builds it and the rows) with --layers of its 32 decoder layers (--full-layers for full fine-tuning, whose
weights, gradients and AdamW states take 8 bytes a weight), synthetic SFT rows of --min-len to --seq-len
(default 4,096) tokens, batch 1, bf16 (both sides: the model loaded in bf16, AdamW's states in bf16,
the forward under bf16 autocast as TRL's bf16=True runs it; memfit's DeepSpeed engine would keep fp32
master weights, not measured here), flash_attention_2 where flash-attn imports else sdpa, --grad-ckpt
on both sides (non-reentrant). Variants on CUDA add trl+liger (use_liger_kernel=True: Liger's RMSNorm,
RoPE, SwiGLU; TRL 1.16 keeps its own chunked LM-head loss) and memfit+liger (RunConfig.kernels liger:
memfit.train.liger's patch and fused linear cross-entropy), each skipped with the reason where Liger
cannot run (memfit.train.liger's checks: no package, no GPU). MFU there is against the GPU's measured
bf16 8192^3 GEMM rate (as gpu_evidence.py's context stage measures it) and, in `mfu_vendor`, against the
datasheet's dense bf16 peak from memfit's GPU catalog (config/gpus.yaml: H100 SXM and H200 989.5
TFLOP/s dense, NVIDIA's datasheets). The attention term counts full T x T products, as PaLM's formula does
(a causal kernel computes about half). N leaves out an untied input embedding (a lookup, no FLOPs).
--scale K divides a catalog model's widths and vocabulary by K: a CPU-sized run of the same code, to
check the wiring only (its output file says _scaleK). benchmarks/gpu_trainer_speed.py runs this as
gpu_evidence.py's trainer_speed stage.

Output: a table on stdout and benchmarks/results/trainer_speed_cpu.json (the demo on the CPU), or
trainer_speed_<gpu>.json (llama-3.1-8b on a GPU; <gpu> memfit's catalog name) (--out).

Usage: .venv/bin/python benchmarks/bench_trainer_speed.py [--steps 20 --warmup 5 --rounds 2 --batch 8]
       python benchmarks/bench_trainer_speed.py --device cuda --layers 32 --full-layers 8 --methods sft \
           --variants trl,trl+liger,memfit,memfit+liger --warmup 3 --steps 10 --rounds 1
"""

from __future__ import annotations

import argparse
import dataclasses
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
import trainer_speed_setup as setup  # noqa: E402
from bench_dpo_vs_trl import REPO, run_memfit, run_trl, timed_train, trl_args  # noqa: E402


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def liger_status(model_dir: Path | None = None) -> str | None:
    """None when Liger's kernels can run here (TRL's use_liger_kernel, memfit's kernels: liger), else
    why not: memfit.train.liger's own checks (the package and Triton, a CUDA GPU, the model type)."""
    from memfit.train import liger

    if liger.interpreted():  # Triton's interpreter is for memfit's tests, far too slow to time
        return "skipped: TRITON_INTERPRET=1 (Triton's interpreter) is set"
    why = liger.problem(str(model_dir)) if model_dir is not None and liger.installed() else liger.runtime_problem()
    return f"skipped: {why}" if why else None


def run_trl_sft(model_dir: Path, rows: list[dict], a, out: Path, peft_config=None, load=None, **extra) -> dict:
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
        model=load(model_dir),
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
    n, layers, d = setup.matmul_params(model_dir)
    attn = layers * d * seq
    f = 6 * n + 12 * attn if finetune == "full" else 4 * n + 8 * attn
    return f + (2 * n + 4 * attn if method == "dpo" else 0)


LIGER = ("trl+liger", "memfit+liger")


def variants(method: str) -> list[tuple[str, dict]]:
    """(name, options) of each side run for `method`."""
    return [
        ("trl", {}),
        ("trl+padding_free", {"padding_free": True}),
        ("trl+compile", {"torch_compile": True}),
        ("trl+liger", {"use_liger_kernel": True}),
        ("memfit", {}),
        ("memfit+compile", {"compile": True}),
        ("memfit+padding_free", {"padding_free": True}),
        ("memfit+compile+padding_free", {"compile": True, "padding_free": True}),
        ("memfit+liger", {"kernels": "liger"}),
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
    setup.free_device()
    peft = lora_config() if finetune == "lora" else None
    rows, model_dir, pad_id = ctx["rows"][method], ctx["model_dir"][finetune], ctx["pad_id"]
    if name.startswith("trl"):
        if opts.get("torch_compile"):  # room for the steps that compile (not measured: timed_train)
            opts = opts | {"max_steps": a.warmup + 3 * a.steps}
        opts = ctx["trl_args"] | opts
        if method == "sft":
            return run_trl_sft(model_dir, rows, a, out, peft, load=ctx["load"], **opts)
        return run_trl(model_dir, ctx["records"], a, out, peft, load=ctx["load"], **opts)
    load = ctx["memfit_load"]
    if opts.get("padding_free") and load.attn == "sdpa":
        from memfit.train import varlen_attention

        # as memfit.train.modeling.attn_implementation loads a padding_free sdpa candidate
        load = dataclasses.replace(load, attn=varlen_attention.register())
    return run_memfit(model_dir, rows, a, pad_id, method, peft, load=load, autocast=ctx["autocast"], **opts)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="measured steps (after warm-up)")
    p.add_argument("--warmup", type=int, default=5, help="steps before the clock starts (compile happens here)")
    p.add_argument("--batch", type=int, help="rows (SFT) or pairs (DPO) per step (default 8; a catalog model 1)")
    p.add_argument("--max-len", type=int, default=64, help="demo model: data.max_len, tokens per row")
    p.add_argument("--rows", type=int, default=256, help="training rows drawn from")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--methods", default="sft,dpo", help="sft,dpo (a catalog model: sft only)")
    p.add_argument("--finetunes", default="full,lora")
    p.add_argument("--variants", help="comma-separated variant names to run (default: all; see --list-variants)")
    p.add_argument("--list-variants", action="store_true")
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
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (default, also on a GPU machine: the committed CPU result keeps its meaning) or cuda",
    )
    p.add_argument(
        "--model",
        help="demo (the embedded demo model and data) or a catalog model name (config/models.yaml) with random "
        "weights and synthetic rows; default: demo on the CPU, llama-3.1-8b on cuda",
    )
    p.add_argument("--layers", type=int, help="catalog model: decoder layers built (default: all)")
    p.add_argument(
        "--full-layers", type=int, help="catalog model, full fine-tuning: decoder layers (default: --layers)"
    )
    p.add_argument("--scale", type=int, default=1, help="catalog model: sizes divided by it (a CPU wiring check)")
    p.add_argument("--seq-len", type=int, default=4096, help="catalog model: the longest synthetic row")
    p.add_argument("--min-len", type=int, help="catalog model: the shortest synthetic row (default: --seq-len)")
    p.add_argument("--precision", choices=("fp32", "bf16"), help="default fp32 on the CPU, bf16 on cuda")
    p.add_argument(
        "--attn", default="auto", help="auto (flash_attention_2 if importable on cuda, else sdpa), sdpa, ..."
    )
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing on both sides")
    p.add_argument("--out", type=Path, help="default benchmarks/results/trainer_speed_<cpu|gpu>[_<model>].json")
    a = p.parse_args(argv)
    if a.list_variants:
        print("\n".join(name for name, _ in variants("sft")))
        raise SystemExit(0)
    if a.warmup < 1 or a.steps < 1 or a.rounds < 1:
        p.error("--warmup, --steps and --rounds must be >= 1")
    a.model = a.model or ("demo" if a.device == "cpu" else "llama-3.1-8b")
    a.precision = a.precision or ("fp32" if a.device == "cpu" else "bf16")
    a.batch = a.batch or (8 if a.model == "demo" else 1)
    a.min_len = a.min_len or a.seq_len
    methods, finetunes = a.methods.split(","), a.finetunes.split(",")
    if bad := [m for m in methods if m not in ("sft", "dpo")] + [f for f in finetunes if f not in ("full", "lora")]:
        p.error(f"unknown --methods/--finetunes value(s) {bad} (methods: sft, dpo; finetunes: full, lora)")
    if a.model != "demo" and "dpo" in methods:
        p.error(
            f"--methods dpo with --model {a.model}: synthetic rows are SFT only (TRL's DPOTrainer tokenizes "
            "text pairs itself); use --methods sft, or --model demo for DPO"
        )
    if a.model != "demo" and not 1 <= a.min_len <= a.seq_len:
        p.error(f"--min-len {a.min_len} must be between 1 and --seq-len {a.seq_len}")
    if a.scale < 1:
        p.error(f"--scale {a.scale} must be >= 1")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False)")
    names = [name for name, _ in variants("sft")]
    a.variants = a.variants.split(",") if a.variants else names
    if bad := [v for v in a.variants if v not in names]:
        p.error(f"unknown --variants value(s) {bad} (variants: {', '.join(names)})")
    return a


def default_out(a) -> Path:
    """trainer_speed_cpu.json for the demo on the CPU (the committed result), trainer_speed_<gpu>.json
    for llama-3.1-8b on a GPU (<gpu>: memfit's catalog name, detect_gpu), else both names with the
    model (and a --scale) added."""
    if a.device == "cpu":
        where = "cpu"
    else:
        from memfit.estimate.models.detect import detect_gpu

        try:
            where = detect_gpu()
        except ValueError:  # a GPU memfit's catalog does not list: torch's name for it
            where = torch.cuda.get_device_name().lower().replace(" ", "-")
    default = "demo" if a.device == "cpu" else "llama-3.1-8b"
    name = f"trainer_speed_{where}" + ("" if a.model == default else f"_{a.model}")
    return REPO / "benchmarks/results" / (name + (f"_scale{a.scale}" if a.scale > 1 else "") + ".json")


def prepare(a, tmp: Path) -> dict:
    """The model directories (per finetune), rows and loaders every variant runs with."""
    from transformers import AutoConfig, AutoTokenizer

    from memfit import data
    from memfit.workflow.demo import build_demo_model

    dtype = torch.bfloat16 if a.precision == "bf16" else torch.float32
    attn = setup.attention_impl(a.attn, a.device)
    ctx: dict = {"rows": {}, "tokens": {}, "attn": attn}
    if a.model == "demo":
        model_dir = tmp / "demo-tiny"
        build_demo_model(REPO / "config/models/demo-tiny.json", REPO / "data/demo", model_dir)
        ctx["model_dir"] = {"full": model_dir, "lora": model_dir}
    else:
        lora = setup.catalog_model_dir(a.model, a.layers, a.scale, a.seq_len, tmp / "model-lora")
        full_layers = a.full_layers or a.layers
        full = lora  # the same model unless --full-layers names another layer count
        if full_layers != a.layers:
            full = setup.catalog_model_dir(a.model, full_layers, a.scale, a.seq_len, tmp / "model-full")
        ctx["model_dir"] = {"lora": lora, "full": full}
        model_dir = lora
    tok = AutoTokenizer.from_pretrained(model_dir)
    ctx["pad_id"] = tok.pad_token_id
    for m in a.methods.split(","):
        if a.model == "demo":
            data.prepare(m, REPO / f"data/demo/{m}.jsonl", model_dir, tmp / m, max_len=a.max_len, eval_fraction=0.05)
            rows = data.load_split(tmp / m, "train")[: a.rows]
        else:
            vocab = AutoConfig.from_pretrained(model_dir).vocab_size
            rows = setup.synthetic_sft_rows(a.rows, a.seq_len, a.min_len, vocab, len(tok), a.seed)
        ctx["rows"][m] = rows
        if m == "sft":
            ctx["tokens"][m] = statistics.mean(len(r["input_ids"]) for r in rows)
        else:
            ctx["tokens"][m] = statistics.mean(
                2 * len(r["prompt_ids"]) + len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in rows
            )
            lines = (REPO / "data/demo/dpo.jsonl").read_text().splitlines()
            ctx["records"] = [json.loads(lines[r["row"] - 1]) for r in rows]
    ctx["load"] = setup.Loader(a.device, dtype, attn, a.seed)
    ctx["memfit_load"] = setup.Loader(a.device, dtype, attn, a.seed, grad_ckpt=a.grad_ckpt)
    # bf16 (a GPU): TRL's Trainer runs the forward under accelerate's bf16 autocast; memfit's side
    # the same (run_memfit's autocast), so LoRA's fp32 adapters compute alike on both sides
    ctx["autocast"] = dtype if a.precision == "bf16" else None
    ctx["trl_args"] = {"use_cpu": a.device == "cpu", "bf16": a.precision == "bf16"}
    if a.grad_ckpt:
        ctx["trl_args"] |= {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}}
    return ctx


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    # memfit's device is DeepSpeed's accelerator (memfit.train.dist.device; FusedAdam's op too):
    # bench_dpo_vs_trl defaults it to cpu; nothing has imported DeepSpeed yet
    os.environ["DS_ACCELERATOR"] = a.device
    assert "deepspeed" not in sys.modules, "DeepSpeed was imported before its accelerator was chosen"
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    a.out = a.out or default_out(a)
    methods, finetunes = a.methods.split(","), a.finetunes.split(",")

    results: dict[str, list[dict]] = {}
    loads: list[dict] = []
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ctx = prepare(a, tmp)
        tokens = ctx["tokens"]
        for name in LIGER:
            if name in a.variants and (why := liger_status(ctx["model_dir"]["lora"])):
                skipped[name] = why
                print(f"{name}: {why}", flush=True)
        run = [(n, o) for n, o in variants("sft") if n in a.variants and n not in skipped]
        peak = matmul_peak() if a.device == "cpu" else setup.gpu_matmul_peak()
        vendor = setup.vendor_peak() if a.device == "cuda" else None
        seq = {m: tokens[m] / (2 if m == "dpo" else 1) for m in methods}  # mean sequence length
        fpt = {(m, f): flops_per_token(ctx["model_dir"][f], f, m, seq[m]) for m in methods for f in finetunes}
        for k in range(a.rounds):
            load = {"round": k, "before": os.getloadavg()}
            for m in methods:
                for f in finetunes:
                    for name, opts in run:
                        key = f"{m}/{f}/{name}"
                        r = run_one(name, opts, m, f, ctx, a, tmp / f"{key.replace('/', '_')}{k}")
                        r["tokens_per_s"] = r["steps_per_s"] * a.batch * tokens[m]
                        r["mfu"] = r["tokens_per_s"] * fpt[(m, f)] / peak
                        if vendor and vendor["flops"]:
                            r["mfu_vendor"] = r["tokens_per_s"] * fpt[(m, f)] / vendor["flops"]
                        if a.device == "cuda":
                            r["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                        results.setdefault(key, []).append(r)
                        print(
                            f"round {k} {key}: {r['steps_per_s']:.2f} steps/s, {r['tokens_per_s']:.0f} tok/s",
                            flush=True,
                        )
            load["after"] = os.getloadavg()
            loads.append(load)
        setup.free_device()
        shape = {f: json.loads((ctx["model_dir"][f] / "config.json").read_text()) for f in finetunes}

    best = {k: max(v, key=lambda r: r["steps_per_s"]) for k, v in results.items()}
    table = []
    for m in methods:
        for f in finetunes:
            trl = best.get(f"{m}/{f}/trl")
            for name, _ in run:
                b = best[f"{m}/{f}/{name}"]
                row = {
                    "method": m,
                    "finetune": f,
                    "variant": name,
                    "tokens_per_s": round(b["tokens_per_s"], 1),
                    "mfu": round(b["mfu"], 5),
                    "vs_trl": round(b["steps_per_s"] / trl["steps_per_s"], 3) if trl else None,
                }
                if "mfu_vendor" in b:
                    row["mfu_vendor"] = round(b["mfu_vendor"], 5)
                table.append(row)
    shares = {m: padding_share(ctx["rows"][m], m, a.batch, a.seed) for m in methods}
    report_print(a, ctx, peak, vendor, loads, shares, table, skipped)
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
    if a.device == "cuda" or a.model != "demo":
        report["gpu"] = {"name": torch.cuda.get_device_name(), "vendor_peak": vendor} if a.device == "cuda" else None
        report["attn"] = ctx["attn"]
        report["model_config"] = {
            f: {k: c.get(k) for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size")}
            for f, c in shape.items()
        }
        report["skipped"] = skipped
        import importlib.metadata as md

        for d in ("liger-kernel", "deepspeed", "peft", "flash-attn"):
            try:
                report["versions"][d] = md.version(d)
            except md.PackageNotFoundError:
                report["versions"][d] = None
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"wrote {a.out}")


def report_print(a, ctx, peak, vendor, loads, shares, table, skipped) -> None:
    prec = a.precision + (", gradient checkpointing" if a.grad_ckpt else "")
    where = (
        f"{torch.cuda.get_device_name()}, bf16 GEMM peak {peak / 1e12:.0f} TFLOP/s measured"
        + (f", {vendor['flops'] / 1e12:.1f} datasheet ({vendor['source']})" if vendor and vendor["flops"] else "")
        if a.device == "cuda"
        else f"torch threads {torch.get_num_threads()}, matmul peak {peak / 1e9:.1f} GFLOP/s"
    )
    print(
        f"\nsettings: {a.model}, batch {a.batch}, "
        + (f"max_len {a.max_len}" if a.model == "demo" else f"rows of {a.min_len}-{a.seq_len} tokens")
        + f", warmup {a.warmup}, measured steps {a.steps}, rounds {a.rounds} (best shown), {prec}, "
        f"{ctx['attn']}, 1 process, {where}; load average per round {[(x['before'][0], x['after'][0]) for x in loads]}"
    )
    print(f"TRL use_liger_kernel: {skipped.get('trl+liger') or liger_status() or 'available'}")
    print("padding share of a padded batch: " + ", ".join(f"{m} {v:.1%}" for m, v in shares.items()))
    vend = any("mfu_vendor" in r for r in table)
    print(
        f"{'method':6} {'finetune':8} {'variant':22} {'tokens/s':>10} {'MFU':>8} "
        + ("MFU(datasheet) " if vend else "")
        + f"{'x TRL':>7}"
    )
    for row in table:
        x = f"{row['vs_trl']:>7.3f}" if row["vs_trl"] is not None else f"{'-':>7}"
        v = f"{row['mfu_vendor']:>14.2%} " if vend else ""
        print(
            f"{row['method']:6} {row['finetune']:8} {row['variant']:22} {row['tokens_per_s']:>10.0f} "
            f"{row['mfu']:>8.2%} {v}{x}"
        )


if __name__ == "__main__":
    main()
