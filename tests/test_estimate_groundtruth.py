"""Ground truth: real training steps of small Llama- and Qwen2-shaped models on the CPU,
measured with `memory.AllocationTracker`, against `estimate()`'s allocated peak.

What the ground truth covers: transformers' own modeling code (eager and SDPA attention,
gradient checkpointing, peft LoRA), memfit's losses (SFT cross-entropy, DPO with the
concatenated chosen+rejected forward and a frozen reference model), plain
`torch.optim.AdamW` over fp32 weights on one rank, i.e. ZeRO stage 0 without DeepSpeed,
measured over two full steps (the first with lazy Adam state, the second with it resident)
through the trainer's own `StepRunner.loss` (memfit.train.steps). It does not cover DeepSpeed's bf16/ZeRO buffers
(checked against DeepSpeed's own formulas in test_estimate.py), CUDA kernels' workspaces or the
allocator's fragmentation.
"""

from __future__ import annotations

import dataclasses
import os
import statistics

import pytest
import torch

# At import, not inside `measure`: importing peft imports bitsandbytes, whose CPU backend logs a
# warning carrying the ImportError of its optional `kernels` package; the exception's traceback
# keeps every frame of the stack alive, and pytest's log capture keeps the record for the whole
# test, so an import inside `measure` kept that measure's models alive into the next one.
from peft import LoraConfig, get_peft_model

from memfit.estimate import Settings, estimate
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.models.catalog import GPU
from memfit.space import Candidate
from memfit.train.memory import AllocationTracker
from memfit.train.modeling import attn_implementation
from memfit.train.steps import StepRunner

CPU = GPU(
    name="cpu",
    memory_bytes=64 * 2**30,
    bf16=True,
    flash_attn2=False,
    compute_capability="0.0",
    tflops_bf16=1.0,
    tflops_fp16=1.0,
    tflops_fp32=1.0,
    memory_bandwidth_gbs=50.0,
    host_link_gbs=50.0,
    interconnect_gbs=10.0,
    typical_gpus_per_node=1,
    typical_host_memory_gb=64.0,
    source="test",
)

SHAPES = {
    # Llama-shaped: GQA (4 heads, 2 KV heads), SwiGLU, untied embeddings
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=176,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=512,
        tie_word_embeddings=False,
        attention_bias=False,
    ),
    # Qwen2-shaped: q/k/v biases, MHA-ish GQA, tied embeddings, larger vocabulary
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=96,
        intermediate_size=256,
        num_layers=3,
        num_attention_heads=6,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=1024,
        tie_word_embeddings=True,
        attention_bias=True,
    ),
}


def make_arch(kind: str) -> ModelArch:
    return ModelArch(name=f"tiny-{kind}", max_position_embeddings=4096, **SHAPES[kind])


def hf_config(kind: str, attn: str, **extra):
    """The HF config of the `kind` shape (Llama or Qwen2) with `attn` attention, plus `extra` keys."""
    from transformers import LlamaConfig, Qwen2Config

    s = SHAPES[kind]
    return (LlamaConfig if kind == "llama" else Qwen2Config)(
        hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"],
        num_hidden_layers=s["num_layers"],
        num_attention_heads=s["num_attention_heads"],
        num_key_value_heads=s["num_kv_heads"],
        head_dim=s["head_dim"],
        vocab_size=s["vocab_size"],
        max_position_embeddings=4096,
        tie_word_embeddings=s["tie_word_embeddings"],
        attn_implementation=attn,
        use_cache=False,
        **extra,
    )


def training_mode(model, cand: Candidate):
    """`model` in train mode with the candidate's checkpointing; its AdamW over the trainable parameters."""
    model.train()
    if cand.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=False)


def build_model(kind: str, attn: str):
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    cfg = hf_config(kind, attn)
    torch.manual_seed(0)
    return (LlamaForCausalLM if kind == "llama" else Qwen2ForCausalLM)(cfg)


class _Engine:
    """What StepRunner needs of a DeepSpeed engine, on a plain torch model: call it, and `.module`."""

    def __init__(self, model) -> None:
        self.module = model

    def __call__(self, **kwargs):
        return self.module(**kwargs)


def measure(kind: str, method: str, cand: Candidate, steps: int = 2, chunk: int | None = None, pad: int = 0) -> int:
    """Peak live bytes of `steps` optimizer steps, as memfit's trainer runs them (train.py)."""
    attn = attn_implementation(cand)  # the trainer's: padding_free sdpa runs memfit's per-sequence sdpa
    model = build_model(kind, attn)
    ref = build_model(kind, attn).eval().requires_grad_(False) if (method == "dpo" and cand.ref == "model") else None
    if cand.finetune == "lora":
        model = get_peft_model(
            model,
            LoraConfig(
                r=cand.lora_rank,
                lora_alpha=2 * cand.lora_rank,
                target_modules="all-linear",
                lora_dropout=0.0,
            ),
        )
    opt = training_mode(model, cand)
    V = SHAPES[kind]["vocab_size"]
    g = torch.Generator().manual_seed(1)
    # The trainer's own step (memfit.train.steps.StepRunner: collate, forward, memfit's losses) on
    # the plain model; the engine stand-in gives it the DeepSpeed engine's `.module`.
    runner = StepRunner(
        method,
        _Engine(model),
        ref,
        pad_id=0,
        dpo={},
        ref=cand.ref,
        loss_on="all",
        loss_impl=cand.loss_impl,
        loss_chunk_tokens=chunk,
        padding_free=cand.padding_free,
    )

    def rows():
        """A micro batch of random full-length rows; DPO: every token of chosen and rejected scored."""
        n = cand.micro_batch * (2 if method == "dpo" else 1)
        ids = torch.randint(0, V, (n, cand.seq_len), generator=g).tolist()
        if pad:  # rows `pad` tokens short, padded back to seq_len: the batch carries an attention mask
            ids = [x[:-pad] for x in ids]
        if method == "sft":
            return [{"input_ids": x, "labels": x} for x in ids]
        m = cand.micro_batch
        return [{"prompt_ids": [], "chosen_ids": c, "rejected_ids": r} for c, r in zip(ids[:m], ids[m:], strict=True)]

    with AllocationTracker() as t:
        for _ in range(steps):
            loss, _, _ = runner.loss(rows(), pad_to=cand.seq_len if pad else None)
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
    return t.peak_bytes


def predict(kind: str, method: str, cand: Candidate, chunk: int | None = None) -> int:
    e = estimate(
        make_arch(kind),
        CPU,
        1,
        1,
        method,
        cand,
        settings=Settings(optimizer_impl="single", zero0_engine="torch", padding_mask=False, loss_chunk_tokens=chunk),
    )
    return e.training_peak_bytes  # the harness measures a step, no resume


ALL = os.environ.get("MEMFIT_GT_ALL") == "1"


def _cases():
    """kind x method x finetune x attention x checkpointing, each at one of three sizes
    (micro batch 1/2/4 with 24/64/160 tokens, rotating): 32 cases. MEMFIT_GT_ALL=1 runs every
    combination at all three sizes (96 cases, several minutes on 2 shared cores)."""
    base = Candidate(zero=0, precision="fp32", attn="sdpa", micro_batch=1, seq_len=64, ref="precomputed")
    sizes = ((1, 24), (2, 64), (4, 160))
    cases, k = [], 0
    for kind in ("llama", "qwen2"):
        for method in ("sft", "dpo"):
            for finetune in ("full", "lora"):
                for attn in ("sdpa", "eager"):
                    for gc in (False, True):
                        ref = "precomputed" if method == "sft" else ("model" if finetune == "full" else "adapter")
                        for mb, s in sizes if ALL else (sizes[k % 3],):
                            cases.append(
                                (
                                    kind,
                                    method,
                                    dataclasses.replace(
                                        base,
                                        finetune=finetune,
                                        attn=attn,
                                        grad_ckpt=gc,
                                        micro_batch=mb,
                                        seq_len=s,
                                        ref=ref,
                                    ),
                                )
                            )
                        k += 1
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def results():
    out = []
    for kind, method, cand in CASES:
        m = measure(kind, method, cand)
        p = predict(kind, method, cand)
        out.append((kind, method, cand, m, p, (p - m) / m))
    return out


def test_every_case_within_5_percent(results):
    bad = [f"{k} {me} {c.id}: measured {m} predicted {p} ({e:+.1%})" for k, me, c, m, p, e in results if abs(e) > 0.05]
    assert not bad, "\n".join(bad)


def test_median_within_2_percent(results):
    med = statistics.median(abs(r[-1]) for r in results)
    assert med <= 0.02, f"median |error| {med:.2%}"


# loss_impl chunked (memfit.train.vocab_loss) in several chunks of 64 tokens: no full logits, the
# estimator's `chunked_loss_terms` instead of the logit terms
CHUNKED = [
    (
        kind,
        method,
        Candidate(
            finetune=ft,
            attn="sdpa",
            grad_ckpt=gc,
            micro_batch=2,
            seq_len=160,
            zero=0,
            precision="fp32",
            ref="precomputed" if method == "sft" else ("model" if ft == "full" else "adapter"),
            loss_impl="chunked",
        ),
    )
    for kind, method, ft, gc in [
        ("llama", "sft", "full", False),
        ("qwen2", "sft", "lora", True),
        ("llama", "dpo", "lora", False),
        ("qwen2", "dpo", "full", False),
    ]
]


@pytest.mark.parametrize("kind,method,cand", CHUNKED, ids=[f"{k}-{m}-{c.id}" for k, m, c in CHUNKED])
def test_chunked_loss_within_5_percent(kind, method, cand):
    m, p = measure(kind, method, cand, chunk=64), predict(kind, method, cand, chunk=64)
    assert abs(p - m) / m <= 0.05, f"measured {m} predicted {p} ({(p - m) / m:+.1%})"


if __name__ == "__main__":
    import sys

    errs = []
    for kind, method, cand in CASES:
        if len(sys.argv) > 1 and not all(a in f"{kind} {method} {cand.id}" for a in sys.argv[1:]):
            continue
        m = measure(kind, method, cand)
        p = predict(kind, method, cand)
        errs.append((p - m) / m)
        print(f"{kind:6} {method} {cand.id:60} measured {m:>10} predicted {p:>10} {errs[-1]:+.1%}")
    print(f"median |err| {statistics.median(abs(e) for e in errs):.2%} max {max(abs(e) for e in errs):.2%}")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_padded_batch_keeps_the_repeated_keys_values_and_the_mask(kind):
    """With a padding mask transformers turns off SDPA's GQA and repeats K/V to every head
    (integrations/sdpa_attention.py `use_gqa_in_sdpa`); SDPA saves them and the mask. The
    difference from the same batch unpadded is `padding_mask._padding_mask_extra` per layer,
    and `Settings.padding_mask` (the default: memfit's un-packed batches) prices it."""
    from memfit.estimate.memory.padding_mask import padding_mask_extra

    cand = Candidate(zero=0, precision="fp32", attn="sdpa", micro_batch=4, seq_len=64, finetune="lora", lora_rank=8)
    padded, full = measure(kind, "sft", cand, pad=8), measure(kind, "sft", cand)
    arch = make_arch(kind)
    settings = Settings(optimizer_impl="single", zero0_engine="torch", padding_mask=True)
    extra = arch.num_layers * padding_mask_extra(arch, cand, "sft", settings)
    assert extra > 0 and abs((padded - full) - extra) <= 0.15 * extra, (padded - full, extra)
    predicted = estimate(arch, CPU, 1, 1, "sft", cand, settings=settings).training_peak_bytes
    assert abs(predicted / padded - 1) <= 0.05, (predicted, padded)
