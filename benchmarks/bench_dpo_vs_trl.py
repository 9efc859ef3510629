"""DPO training throughput on the CPU: TRL 1.16 DPOTrainer vs memfit's DPO step, same model, data, settings.

Both sides train the embedded demo model (config/models/demo-tiny.json) from the same initial weights on
the same demo DPO pairs (data/demo/dpo.jsonl, tokenized identically; tests/test_trl_parity.py asserts
TRL's tokenization of the conversational pairs equals memfit.data.prepare's ids), with:
sigmoid loss, beta, AdamW(lr, weight_decay=0, betas 0.9/0.999, eps 1e-8) as each trainer builds it by
default (TRL: transformers' adamw_torch_fused; memfit: DeepSpeed's FusedAdam, `fused_adamw`), constant
LR, no grad clipping,
batch B pairs, fp32, sdpa attention, no gradient checkpointing, reference model as a second frozen copy
(no precomputed reference log-probs), 1 process, torch's default CPU threads.

(a) TRL: `trl.DPOTrainer(...).train()` with max_steps = warmup + steps; step times from a callback.
(b) memfit: `memfit.train.steps.StepRunner.loss` (memfit's collate + sequence_logps + dpo_loss) on the plain
    torch model, `loss.backward()`, DeepSpeed's `FusedAdam.step()`: the single-process path without the
    DeepSpeed engine.

steps/s is measured over the steps after the warm-up. Rounds alternate TRL, memfit, TRL, memfit, ... to
spread noise from other load on the machine; the best round of each is reported along with all rounds.

Usage: .venv/bin/python benchmarks/bench_dpo_vs_trl.py [--steps 30 --warmup 5 --batch 8 --rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def load_model(model_dir: Path, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)


def sync() -> None:
    """Wait for the GPU's queued work (a step's clock reads after it); nothing on the CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def batches(rows: list[dict], batch: int, n_steps: int, seed: int) -> list[list[dict]]:
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(rows), generator=g).tolist()
    return [[rows[perm[(s * batch + i) % len(rows)]] for i in range(batch)] for s in range(n_steps)]


def timed_train(trainer_cls, a, **kwargs) -> dict:
    """`trainer_cls(**kwargs).train()` (a TRL trainer whose args run at least warmup + steps steps),
    timed by a callback at each step's end: steps/s over `a.steps` steps after the warm-up. Steps that
    compiled a graph (TrainingArguments.torch_compile: the first, a new batch shape) are not measured
    but summed as compile_s, as on memfit's side (`run_memfit`)."""
    from torch._dynamo.utils import counters
    from transformers import TrainerCallback

    stamps: list[tuple[float, int]] = []

    class Stamp(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if not stamps:
                sync()
                stamps.append((time.perf_counter(), counters["stats"]["unique_graphs"]))

        def on_step_end(self, args, state, control, **kw):
            sync()
            stamps.append((time.perf_counter(), counters["stats"]["unique_graphs"]))

    trainer_cls(callbacks=[Stamp()], **kwargs).train()
    measured: list[float] = []
    compile_s = 0.0
    for i in range(1, len(stamps)):
        dt = stamps[i][0] - stamps[i - 1][0]
        if stamps[i][1] != stamps[i - 1][1]:
            compile_s += dt
        elif i > a.warmup and len(measured) < a.steps:
            measured.append(dt)
    assert len(measured) == a.steps, f"{len(measured)} steps without compiling in {len(stamps) - 1}"
    return {"steps_per_s": a.steps / sum(measured), "seconds": sum(measured), "compile_s": compile_s}


def trl_args(config_cls, a, out: Path, **extra):
    """The TRL config both benchmarks train with: constant LR, AdamW without weight decay, no
    clipping, fp32 on the CPU, no logging or saving, warmup + steps steps of `a.batch` rows; `extra`
    adds or replaces fields (benchmarks/bench_trainer_speed.py: bf16 on a GPU)."""
    fields = dict(
        output_dir=str(out),
        report_to=[],
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch_fused",  # transformers' default TrainingArguments.optim (transformers 5.24)
        max_grad_norm=0.0,  # no clipping (memfit side does not clip either)
        per_device_train_batch_size=a.batch,
        gradient_accumulation_steps=1,
        max_steps=extra.pop("max_steps", a.warmup + a.steps),
        gradient_checkpointing=False,
        use_cpu=True,
        bf16=False,
        fp16=False,
        dataloader_num_workers=0,
        logging_strategy="no",
        save_strategy="no",
        seed=a.seed,
    )
    return config_cls(**(fields | extra))


def dpo_dataset(records: list[dict]):
    """The demo pairs as TRL's conversational preference dataset."""
    from datasets import Dataset

    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": r["prompt"]}],
                "chosen": [{"role": "assistant", "content": r["chosen"]}],
                "rejected": [{"role": "assistant", "content": r["rejected"]}],
            }
            for r in records
        ]
    )


def run_trl(model_dir: Path, records: list[dict], a, out: Path, peft_config=None, load=load_model, **extra) -> dict:
    """TRL's DPOTrainer; with `peft_config` the policy trains LoRA adapters and the reference is the
    adapter-disabled policy (TRL's ref_model=None with peft); `load(model_dir)` builds each model."""
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(a.seed)
    policy = load(model_dir)
    ref = None if peft_config is not None else load(model_dir)
    args = trl_args(DPOConfig, a, out, beta=a.beta, loss_type=["sigmoid"], max_length=None, **extra)
    tok = AutoTokenizer.from_pretrained(model_dir)
    return timed_train(
        DPOTrainer,
        a,
        model=policy,
        ref_model=ref,
        args=args,
        train_dataset=dpo_dataset(records),
        processing_class=tok,
        peft_config=peft_config,
    )


def fused_adamw(params, lr: float):
    """memfit's optimizer: DeepSpeed's FusedAdam in AdamW mode, what the trainer's DeepSpeed config
    ("type": "AdamW", memfit.train.dsconfig) builds on the CPU and CUDA accelerators (a C++ op on the
    CPU: `make ops`); the same update as torch's fused AdamW on TRL's side (adamw_torch_fused)."""
    from deepspeed.ops.adam import FusedAdam

    return FusedAdam(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True)


def run_memfit(
    model_dir: Path,
    rows: list[dict],
    a,
    pad_id: int,
    method: str = "dpo",
    peft_config=None,
    load=load_model,
    autocast: torch.dtype | None = None,
    **runner,
) -> dict:
    """memfit's step (`StepRunner.loss`, backward, AdamW) on the plain torch model; `peft_config`:
    LoRA adapters (DPO's reference the adapter-disabled policy, memfit's ref: adapter); `runner`:
    StepRunner options (padding_free); `compile` in it: memfit.train.compile.compile_layers;
    `kernels` "liger" in it: memfit.train.liger's patch and fused loss (RunConfig.kernels); `load(model_dir)`
    builds each model; `autocast`: the forward under torch.autocast to that dtype (what TRL's bf16=True
    does through accelerate: bench_trainer_speed.py on a GPU)."""
    import contextlib

    from memfit.train.steps import StepRunner

    torch.manual_seed(a.seed)
    policy = load(model_dir)
    ref, ref_mode = None, None
    if method == "dpo":
        ref_mode = "adapter" if peft_config is not None else "model"
        if peft_config is None:
            ref = load(model_dir).eval().requires_grad_(False)
    if peft_config is not None:
        from peft import get_peft_model

        policy = get_peft_model(policy, peft_config)
    if runner.pop("kernels", "none") == "liger":  # as memfit.train.run_parts.step_runner: after peft
        from memfit.train import liger

        print(liger.apply(policy), flush=True)
        runner["loss_impl"] = "liger"
    if runner.pop("compile", False):
        from memfit.train.compile import compile_layers

        compile_layers(policy)
    policy.train()
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = fused_adamw(params, a.lr)
    dpo = {"beta": a.beta, "loss_type": "sigmoid", "label_smoothing": 0.0} if method == "dpo" else None
    step = StepRunner(method, policy, ref, pad_id, dpo=dpo, ref=ref_mode or "model", **runner)
    # steps that compiled a graph (compile: the first step, a new batch length, a batch without
    # padding) are not measured: their time is reported as compile_s and the run goes on until
    # `a.steps` steps after the warm-up compiled nothing (eager: exactly warmup + steps steps)
    from torch._dynamo.utils import counters

    measured: list[float] = []
    compile_s, loss = 0.0, torch.tensor(0.0)
    device = policy.device.type
    for i, b in enumerate(batches(rows, a.batch, a.warmup + a.steps + 200, a.seed)):
        sync()
        graphs, t0 = counters["stats"]["unique_graphs"], time.perf_counter()
        with torch.autocast(device, dtype=autocast) if autocast is not None else contextlib.nullcontext():
            loss, _, _ = step.loss(b)
        loss.backward()
        opt.step()
        opt.zero_grad()  # FusedAdam: set_to_none by default (deepspeed/ops/adam/fused_adam.py)
        sync()
        dt = time.perf_counter() - t0
        if counters["stats"]["unique_graphs"] != graphs:
            compile_s += dt
        elif i >= a.warmup:
            measured.append(dt)
        if len(measured) == a.steps:
            break
    assert len(measured) == a.steps, f"{len(measured)} steps without compiling in {i + 1}"
    dt = sum(measured)
    return {"steps_per_s": a.steps / dt, "seconds": dt, "compile_s": compile_s, "last_loss": float(loss)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="measured steps (after warm-up)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=8, help="pairs per step")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--rows", type=int, default=256, help="demo pairs used as the training set")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    assert a.warmup >= 1 and a.steps >= 1

    from transformers import AutoTokenizer

    from memfit import data
    from memfit.workflow.demo import build_demo_model

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = tmp / "demo-tiny"
        build_demo_model(REPO / "config/models/demo-tiny.json", REPO / "data/demo", model_dir)
        data.prepare("dpo", REPO / "data/demo/dpo.jsonl", model_dir, tmp / "dpo", max_len=24, eval_fraction=0.05)
        rows = data.load_split(tmp / "dpo", "train")[: a.rows]
        lines = (REPO / "data/demo/dpo.jsonl").read_text().splitlines()
        records = [json.loads(lines[r["row"] - 1]) for r in rows]
        pad_id = AutoTokenizer.from_pretrained(model_dir).pad_token_id

        results: dict[str, list[dict]] = {"trl": [], "memfit": []}
        for k in range(a.rounds):
            results["trl"].append(run_trl(model_dir, records, a, tmp / f"trl{k}"))
            results["memfit"].append(run_memfit(model_dir, rows, a, pad_id))
            print(
                f"round {k}: TRL {results['trl'][-1]['steps_per_s']:.2f} steps/s, "
                f"memfit {results['memfit'][-1]['steps_per_s']:.2f} steps/s",
                flush=True,
            )

    best = {k: max(r["steps_per_s"] for r in v) for k, v in results.items()}
    print(
        f"settings: batch={a.batch} pairs, warmup={a.warmup}, measured steps={a.steps}, beta={a.beta}, lr={a.lr}, "
        f"fp32, sdpa, sigmoid, 1 process, torch threads={torch.get_num_threads()}, torch {torch.__version__}"
    )
    print(f"TRL DPOTrainer : {best['trl']:.3f} steps/s (best of {a.rounds})")
    print(f"memfit DPO step: {best['memfit']:.3f} steps/s (best of {a.rounds})")
    print(f"ratio memfit/TRL: {best['memfit'] / best['trl']:.3f} (target >= 1.0)")
    print(json.dumps({"best": best, "rounds": results}))


if __name__ == "__main__":
    main()
