"""Ground truth for the preference methods beside DPO (issue #44): reward model (rm), ORPO,
SimPO and KTO, real training steps of the small Llama- and Qwen2-shaped models of
test_estimate_groundtruth.py on the CPU, measured with `memory.AllocationTracker` over two
optimizer steps through the trainer's own step (memfit.train.steps.StepRunner, which dispatches
to memfit.train.preference.{rm,orpo,simpo,kto}.step), against `estimate()`'s allocated peak,
within the limits the SFT/DPO ground truth holds (every case 5%, the median 2%).

The reward model is what the trainer builds (memfit.train.modeling.load_model with a score pad
id): `*ForSequenceClassification` with num_labels=1 and, beside LoRA, peft's SEQ_CLS task with
the score head in modules_to_save. KTO runs its KL batch through the policy without gradient and
a reference (the frozen model for full fine-tuning, the adapter-disabled policy for LoRA).

Rerun and print the table: `python tests/test_estimate_groundtruth_pref.py [filter words]`.
"""

from __future__ import annotations

import dataclasses
import statistics

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_estimate_groundtruth import CPU, SHAPES, _Engine, build_model, hf_config, make_arch, training_mode

from memfit.estimate import Settings, estimate
from memfit.space import Candidate
from memfit.train.memory import AllocationTracker
from memfit.train.steps import StepRunner

PAD = 0


def build_reward_model(kind: str, attn: str):
    """`AutoModelForSequenceClassification`'s Llama/Qwen2 class with one output and a pad id, as
    memfit.train.preference.rm.build_reward_model makes it from a causal LM's config."""
    from transformers import LlamaForSequenceClassification, Qwen2ForSequenceClassification

    M = LlamaForSequenceClassification if kind == "llama" else Qwen2ForSequenceClassification
    cfg = hf_config(kind, attn, num_labels=1, pad_token_id=PAD)
    torch.manual_seed(0)
    return M(cfg)


def _lora(model, rank: int, reward: bool):
    """The trainer's LoRA (memfit.train.lora.lora_config: all-linear less what peft cannot adapt;
    a reward model's score head trained in full beside it, memfit.train.modeling.load_model)."""
    from memfit.train.lora import lora_config

    config: LoraConfig = lora_config(model, rank)
    if reward:
        config.task_type, config.modules_to_save = "SEQ_CLS", ["score"]
    return get_peft_model(model, config)


def measure(kind: str, method: str, cand: Candidate, steps: int = 2) -> int:
    """Peak live bytes of `steps` optimizer steps of `method`, as memfit's trainer runs them."""
    reward = method == "rm"
    model = build_reward_model(kind, cand.attn) if reward else build_model(kind, cand.attn)
    ref = build_model(kind, cand.attn).eval().requires_grad_(False) if cand.ref == "model" else None
    if cand.finetune == "lora":
        model = _lora(model, cand.lora_rank, reward)
    opt = training_mode(model, cand)
    V = SHAPES[kind]["vocab_size"]
    g = torch.Generator().manual_seed(1)
    runner = StepRunner(method, _Engine(model), ref, pad_id=PAD, ref=cand.ref, loss_impl=cand.loss_impl, pref={})

    def rows():
        """A micro batch of random full-length rows (no padding token in them): pairs with an
        empty prompt (every token a response token), KTO rows alternately desirable."""
        m = cand.micro_batch
        n = m * (1 if method == "kto" else 2)
        ids = torch.randint(1, V, (n, cand.seq_len), generator=g).tolist()
        if method == "kto":
            return [{"prompt_ids": [], "completion_ids": x, "label": i % 2 == 0} for i, x in enumerate(ids)]
        return [{"prompt_ids": [], "chosen_ids": c, "rejected_ids": r} for c, r in zip(ids[:m], ids[m:], strict=True)]

    with AllocationTracker() as t:
        for _ in range(steps):
            loss, _, _ = runner.loss(rows())
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
    return t.peak_bytes


def predict(kind: str, method: str, cand: Candidate) -> int:
    settings = Settings(optimizer_impl="single", zero0_engine="torch", padding_mask=False)
    return estimate(make_arch(kind), CPU, 1, 1, method, cand, settings=settings).training_peak_bytes


def _cases():
    """Per method four cases: llama and qwen2, full and LoRA, each with another of the four
    attention/checkpointing settings and one of three sizes (micro batch 1/2/2 with 24/64/128
    tokens), rotating; 16 in all. KTO's reference: the frozen model (full), the adapter-disabled
    policy (LoRA)."""
    base = Candidate(zero=0, precision="fp32", attn="sdpa", micro_batch=1, seq_len=64, ref="precomputed")
    sizes = ((1, 24), (2, 64), (2, 128))
    settings = (("sdpa", False), ("eager", True), ("sdpa", True), ("eager", False))
    cases, k = [], 0
    for method in METHODS:
        for kind in ("llama", "qwen2"):
            for finetune in ("full", "lora"):
                attn, gc = settings[(k + k // 4) % 4]  # each method pairs them differently
                mb, s = sizes[k % 3]
                ref = ("model" if finetune == "full" else "adapter") if method == "kto" else "precomputed"
                cand = dataclasses.replace(
                    base, finetune=finetune, attn=attn, grad_ckpt=gc, micro_batch=mb, seq_len=s, ref=ref
                )
                cases.append((kind, method, cand))
                k += 1
    return cases


METHODS = ("rm", "orpo", "simpo", "kto")
CASES = _cases()


@pytest.mark.parametrize("method", METHODS)
def test_estimate_within_the_sft_dpo_limits(method):
    """Every case within 5% of the measured peak, the median within 2% (test_estimate_groundtruth's limits)."""
    rows = []
    for kind, m, cand in CASES:
        if m == method:
            measured, predicted = measure(kind, m, cand), predict(kind, m, cand)
            rows.append(
                (f"{kind} {m} {cand.id}: measured {measured} predicted {predicted}", (predicted - measured) / measured)
            )
    bad = [f"{what} ({e:+.1%})" for what, e in rows if abs(e) > 0.05]
    assert not bad, "\n".join(bad)
    median = statistics.median(abs(e) for _, e in rows)
    assert median <= 0.02, f"{method}: median |error| {median:.2%}"


@pytest.mark.parametrize("case", [0, 3])  # llama full, qwen2 LoRA
def test_a_traced_reward_model_within_5_percent(case, tmp_path):
    """The traced path (Settings.activations="traced", what a generic card always takes): a reward
    model is traced as its causal LM and the head's terms swapped for the score's
    (memfit.estimate.trace.traced.traced_activations); the estimate holds the same limit."""
    kind, method, cand = [c for c in CASES if c[1] == "rm"][case]
    settings = Settings(
        optimizer_impl="single",
        zero0_engine="torch",
        padding_mask=False,
        activations="traced",
        trace_cache=str(tmp_path),
    )
    e = estimate(make_arch(kind), CPU, 1, 1, method, cand, settings=settings)
    measured = measure(kind, method, cand)
    assert e.activations_source == "traced"
    assert abs(e.training_peak_bytes / measured - 1) <= 0.05, (cand.id, e.training_peak_bytes, measured)


if __name__ == "__main__":
    import sys

    errs = []
    for kind, method, cand in CASES:
        if len(sys.argv) > 1 and not all(a in f"{kind} {method} {cand.id}" for a in sys.argv[1:]):
            continue
        m, p = measure(kind, method, cand), predict(kind, method, cand)
        errs.append((p - m) / m)
        print(f"{kind:6} {method:5} {cand.id:60} measured {m:>10} predicted {p:>10} {errs[-1]:+.1%}", flush=True)
    print(f"median |err| {statistics.median(abs(e) for e in errs):.2%} max {max(abs(e) for e in errs):.2%}")
