"""A forward of one sequence carries no padding, in the probe and in the estimate; a padded
forward (2+ rows of different lengths) costs what the estimator prices.

Training pads a micro batch to its longest row (memfit.train.batches.collate), so an SFT micro
batch of 1 is never padded: transformers drops its all-ones mask and SDPA runs causal with its
own GQA. The probe used to pad its longest row to seq_len, measuring a step training never runs
(the H200's long-context probes: s^2 bytes over the estimate, 3.6x its step time). Now its row
is filled with its own tokens (batches.fill_row), and the estimator's padding terms
(padding_mask._padding_mask_extra, _padding_mask_once) apply to 2+ rows only.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from memfit import cli
from memfit.data import worst_case_batch
from memfit.estimate import Settings, estimate
from memfit.space import Candidate
from memfit.train.loop import Run
from memfit.train.modeling import attn_implementation
from memfit.train.steps import StepRunner

SEQ = 96  # the demo model's context is 128; its prepared rows are at most 32 tokens


class _Engine:
    """What StepRunner needs of a DeepSpeed engine, on a plain torch model: call it, and `.module`."""

    def __init__(self, model) -> None:
        self.module = model

    def __call__(self, **kwargs):
        return self.module(**kwargs)


def _probe_step(demo_model, data_dir, micro_batch: int, monkeypatch, padding_free: bool = False):
    """The probe's worst-case micro batch (Run._worst_case_units, as `Run.probe` takes it)
    run through the trainer's step as `train_step` runs a probe (pad_to=seq_len), with a spy on
    the SDPA call transformers makes. Returns (the SDPA calls' arguments, loss, tokens, rows)."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import sdpa_attention

    trainer = SimpleNamespace(
        _probe_units=None,
        cfg=SimpleNamespace(packing=False, data_dir=str(data_dir), method="sft"),
        cand=Candidate(micro_batch=micro_batch, seq_len=SEQ, attn="sdpa", padding_free=padding_free),
    )
    rows = Run._worst_case_units(trainer)
    attn = attn_implementation(trainer.cand)  # the trainer's (memfit.train.modeling)
    model = AutoModelForCausalLM.from_pretrained(demo_model, attn_implementation=attn).train()
    runner = StepRunner("sft", _Engine(model), None, pad_id=model.config.pad_token_id, padding_free=padding_free)
    calls = []
    real = sdpa_attention.torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append({"attn_mask": attn_mask, "is_causal": is_causal, "enable_gqa": kw.get("enable_gqa", False)})
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(sdpa_attention.torch.nn.functional, "scaled_dot_product_attention", spy)
    loss, _, tokens = runner.loss(rows, pad_to=SEQ)
    loss.backward()
    return calls, float(loss.detach()), tokens, rows


def test_a_probe_of_one_sft_row_runs_it_unpadded_as_training_does(demo_model, demo_data, monkeypatch):
    calls, loss, tokens, rows = _probe_step(demo_model, demo_data / "sft", 1, monkeypatch)
    assert len(calls) == 4  # the demo model's layers: 4 heads over 2 KV heads
    for c in calls:  # no mask: SDPA's causal kernel and its own GQA, as a training step of one row
        assert c["attn_mask"] is None and c["is_causal"] is True and c["enable_gqa"] is True, c
    # the data's longest row, its own tokens (and labels alike) repeated to seq_len: every token real
    (row,) = rows
    (longest,) = worst_case_batch(demo_data / "sft", 1)
    n = len(longest["input_ids"])
    assert n < SEQ and tokens == SEQ and math.isfinite(loss)
    for key in ("input_ids", "labels"):
        assert row[key] == (list(longest[key]) * (SEQ // n + 1))[:SEQ], key


def test_a_padding_free_probe_of_one_row_runs_it_unpadded(demo_model, demo_data, monkeypatch):
    calls, loss, tokens, _ = _probe_step(demo_model, demo_data / "sft", 1, monkeypatch, padding_free=True)
    assert calls and all(c["attn_mask"] is None and c["is_causal"] for c in calls), calls
    assert tokens == SEQ and math.isfinite(loss)


def test_a_probe_of_two_rows_keeps_them_padded(demo_model, demo_data, monkeypatch):
    """Rows of different lengths are padded in training too: the probe pads them to seq_len."""
    calls, loss, tokens, rows = _probe_step(demo_model, demo_data / "sft", 2, monkeypatch)
    assert all(len(r["input_ids"]) < SEQ for r in rows)
    for c in calls:  # the (b, 1, s, s) bool mask; K/V repeated to every head, no causal kernel
        m = c["attn_mask"]
        assert m is not None and m.dtype == torch.bool and tuple(m.shape) == (2, 1, SEQ, SEQ)
        assert c["is_causal"] is False and c["enable_gqa"] is False
    assert tokens == sum(len(r["input_ids"]) for r in rows) and math.isfinite(loss)


def _activations(capsys, micro_batch: int, seq_len: int) -> int:
    argv = ["--model", "llama-3.1-8b", "--gpu", "h200", "--finetune", "lora", "--attn", "sdpa", "--zero", "2"]
    rc = cli.main(["estimate", *argv, "--grad-ckpt", "off", "--micro-batch", str(micro_batch), "--seq-len", str(seq_len), "--json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert rc in (0, 1)
    return out["breakdown"]["activations"]


def test_the_estimate_of_one_long_row_carries_no_padding_terms(capsys):
    """Llama-3.1-8B LoRA at 65,536 tokens: one row has no mask, so no repeated K/V (32 heads over 8
    KV heads) and no s^2 mask; the same tokens as 2 rows of 32,768 are padded and pay both in
    every layer (no checkpointing: all 32 layers keep them)."""
    from memfit.estimate.models import catalog

    arch = catalog.model("llama-3.1-8b")
    one, two = _activations(capsys, 1, 65536), _activations(capsys, 2, 32768)
    t, d, s = 65536, 2, 32768
    repeated_kv = 2 * d * t * (arch.num_attention_heads - arch.num_kv_heads) * arch.head_dim
    per_layer = repeated_kv + d * 2 * s * s  # + the mask SDPA converts to bf16 in every layer
    assert abs((two - one) / (arch.num_layers * per_layer) - 1) < 0.01, (two - one, arch.num_layers * per_layer)


def test_the_estimate_of_one_row_is_the_same_with_or_without_padding_mask():
    from memfit.estimate.models import catalog
    from memfit.estimate.models.catalog import gpu

    cand = Candidate(zero=2, precision="bf16", attn="sdpa", micro_batch=1, seq_len=65536, finetune="lora", grad_ckpt=False)  # fmt: skip
    arch = catalog.model("llama-3.1-8b")
    on, off = (
        estimate(arch, gpu("h200"), 1, 1, "sft", cand, settings=Settings(padding_mask=p)).peak_allocated_bytes
        for p in (True, False)
    )
    assert on == off


@pytest.mark.slow
@pytest.mark.parametrize("heads", ["gqa", "mha"])
@pytest.mark.parametrize("grad_ckpt", [False, True], ids=["no-ckpt", "ckpt"])
def test_a_padded_forward_costs_what_the_estimate_prices(heads, grad_ckpt, monkeypatch):
    """Two rows of 512 tokens, 8 short and padded back (tiny Llama, LoRA, fp32, the trainer's step):
    the padded step over the same rows unpadded is the estimator's padding terms: per layer the
    repeated K/V (GQA) and the mask SDPA converts to the model dtype, and the bool mask once
    (checkpointing keeps it as every layer's input). Measured: +0.00% without checkpointing,
    +0.0/+2.3% (MHA/GQA) with it."""
    import test_estimate_groundtruth as gt

    kind = "llama"
    if heads == "mha":  # 4 heads, 4 KV heads: no repeated K/V, the masks alone
        kind = "mha"
        monkeypatch.setitem(gt.SHAPES, "mha", {**gt.SHAPES["llama"], "model_type": "qwen2", "num_kv_heads": 4})
    cand = Candidate(zero=0, precision="fp32", attn="sdpa", micro_batch=2, seq_len=512, finetune="lora", lora_rank=8, grad_ckpt=grad_ckpt)  # fmt: skip
    padded, full = gt.measure(kind, "sft", cand, pad=8), gt.measure(kind, "sft", cand)
    arch = gt.make_arch(kind)
    pred = {
        p: estimate(
            arch,
            gt.CPU,
            1,
            1,
            "sft",
            cand,
            settings=Settings(optimizer_impl="single", zero0_engine="torch", padding_mask=p),
        ).training_peak_bytes  # fmt: skip
        for p in (True, False)
    }
    assert padded - full > 2 * 512 * 512  # the s^2 terms are visible
    assert abs((pred[True] - pred[False]) / (padded - full) - 1) <= 0.05, (pred, padded, full)
    assert abs(pred[True] / padded - 1) <= 0.02, (pred[True], padded)
