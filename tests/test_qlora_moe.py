"""QLoRA of mixture-of-experts models: the routed experts' fused 3-D weights in 4 bits
(memfit.train.qlora_experts), trained with LoRA on attention, and priced so by the estimator.

The model is the repo's tiny GLM-4.5-architecture config (config/models/tiny-glm4-moe.json:
glm4_moe, 4 layers, the first dense, 4 routed experts + 1 shared, random init); gpt-oss
(config/models/tiny-gpt-oss.json: transposed experts with biases and its own clamped gate) checks
the other layout transformers' fused experts come in."""

from __future__ import annotations

import copy
import gc
import json
from pathlib import Path

# at import: peft imports bitsandbytes, whose CPU backend logs an ImportError whose traceback
# would keep a measurement's models alive (memfit.estimate.coverage says the same)
import peft  # noqa: F401
import pytest
import torch

from memfit.estimate import Settings, estimate
from memfit.estimate.models import catalog
from memfit.space import Candidate
from memfit.train import qlora_experts
from memfit.train.losses import sft_loss
from memfit.train.memory import AllocationTracker
from memfit.train.modeling import experts_left_frozen, load_model

bnb = pytest.importorskip("bitsandbytes")

CONFIGS = Path(__file__).parent.parent / "config" / "models"


def _config(name: str):
    from transformers import CONFIG_MAPPING

    d = json.loads((CONFIGS / f"{name}.json").read_text())
    d.pop("_comment", None)
    return CONFIG_MAPPING[d.pop("model_type")](**d)


def _build(name: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(name), dtype=torch.float32)


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-glm4-moe")
    _build("tiny-glm4-moe").save_pretrained(path)
    return path


def _cand(**kw) -> Candidate:
    c = dict(zero=0, precision="fp32", attn="sdpa", seq_len=64, micro_batch=2, grad_accum=1, finetune="qlora")
    c.update(kw, lora_rank=8)
    return Candidate(**c)


def test_the_experts_load_in_4_bits_and_lora_trains_attention_with_them_frozen(glm_dir):
    model = load_model(str(glm_dir), _cand(), trainable=True)
    experts = qlora_experts.fused_experts(model)
    assert len(experts) == 3  # layers 1-3 (layer 0 is dense: first_k_dense_replace 1)
    for _, m in experts:
        # no 16-bit expert weight left: packed NF4 (two weights a byte), per expert
        assert not [n for n, p in m.named_parameters(recurse=False) if p.dim() == 3]
        assert m.gate_up_proj_4bit.dtype == torch.uint8 and m.gate_up_proj_4bit.shape == (4, 128 * 128 // 2)
        assert m.down_proj_4bit.shape == (4, 128 * 64 // 2) and not m.down_proj_4bit.requires_grad
        assert qlora_experts.expert_state(m, "down_proj", 0).quant_type == "nf4"
    # the attention's linears are bitsandbytes 4-bit too, the experts' packed bytes 4.13 bits a weight
    assert sum(isinstance(x, bnb.nn.Linear4bit) for x in model.modules()) > 0
    assert qlora_experts.packed_bytes(model) < 3 * (4 * 128 * 128 + 4 * 128 * 64) * 4.2 / 8
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".self_attn." in n and ".lora_" in n for n in trainable)
    ids = torch.randint(3, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert all(g.abs().sum() > 0 for n, g in grads.items() if ".lora_B." in n)
    assert all(p.grad is None for _, m in experts for p in m.parameters())


@pytest.mark.parametrize("name", ["tiny-glm4-moe", "tiny-gpt-oss"])
def test_4bit_experts_compute_what_their_dequantized_weights_compute(name):
    """The 4-bit forward against transformers' own eager experts holding the dequantized
    weights: the same function of the input, and a gradient that reaches the input."""
    model = _build(name).requires_grad_(False)
    reference = copy.deepcopy(model)
    qlora_experts.quantize_fused_experts(model, "nf4", torch.float32)
    for (_, q), (_, r) in zip(qlora_experts.fused_experts(model), qlora_experts.fused_experts(reference), strict=True):
        for p in ("gate_up_proj", "down_proj"):
            w = torch.stack([qlora_experts.dequantized(q, p, e) for e in range(q.num_experts)])
            getattr(r, p).data.copy_(w.transpose(1, 2) if r.is_transposed else w)
    reference.config._experts_implementation = "eager"
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    x = model.get_input_embeddings()(ids).requires_grad_(True)
    y = model(inputs_embeds=x).logits
    torch.testing.assert_close(y, reference(inputs_embeds=x).logits, rtol=1e-5, atol=1e-5)
    y.square().mean().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def _measure(path: Path, cand: Candidate) -> tuple[int, int]:
    """Peak live CPU bytes of two SFT steps of memfit's QLoRA model (as
    memfit.estimate.coverage.measure_step_peak measures LoRA): forward, memfit's loss,
    backward, torch AdamW (single-tensor); and the bytes the loaded model holds."""
    model = load_model(str(path), cand, trainable=True)
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=False)
    g = torch.Generator().manual_seed(1)
    with AllocationTracker() as tracker:
        for _ in range(2):
            ids = torch.randint(0, 512, (cand.micro_batch, cand.seq_len), generator=g)
            out = model(input_ids=ids, use_cache=False)
            loss = sft_loss(out.logits, ids.clone())[0]
            del out
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
    del model, opt
    gc.collect()
    return tracker.peak_bytes, held


def test_measured_cpu_peak_is_within_3_percent_of_the_estimate(glm_dir):
    cand = _cand(micro_batch=2, seq_len=64)
    measured, held = _measure(glm_dir, cand)
    arch = catalog.model(glm_dir, allow_moe=True)
    settings = Settings(optimizer_impl="single", zero0_engine="torch", padding_mask=False, activations="traced")
    est = estimate(arch, catalog.gpu("cpu"), 1, 1, "sft", cand, settings=settings)
    assert abs(est.training_peak_bytes / measured - 1) <= 0.03, (est.training_peak_bytes, measured)
    # the experts priced at 4 bits: the params term is what the loaded model holds, within 1%
    assert abs(est.breakdown["params"] / held - 1) <= 0.01, (est.breakdown["params"], held)


def test_targets_that_name_only_the_experts_are_refused_naming_them(glm_dir):
    from memfit.train.lora import lora_config

    model = load_model(str(glm_dir), _cand(), trainable=False)
    config = lora_config(model, 8, targets=["gate_proj", "up_proj", "down_proj"])
    with pytest.raises(ValueError, match=r"gate_up_proj.*stay frozen.*lora_targets"):
        experts_left_frozen(model, config)
