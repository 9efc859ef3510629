"""QLoRA on the CPU: bitsandbytes' 4-bit base under peft LoRA, as memfit's trainer builds it, and
checkpoints that hold the adapter only (memfit.train.adapter_state)."""

import pytest
import torch

from memfit.estimate.models import catalog
from memfit.estimate.models.validity import hardware_problems
from memfit.space import Candidate
from memfit.train.adapter_state import adapter_only_state_dict, load_adapter_state
from memfit.train.modeling import load_model

bnb = pytest.importorskip("bitsandbytes")


def _cand(**kw) -> Candidate:
    c = dict(zero=0, precision="fp32", seq_len=32, micro_batch=2, grad_accum=1, finetune="qlora", lora_rank=8)
    c.update(kw)
    return Candidate(**c)


@pytest.fixture(scope="module")
def qlora_model(demo_model):
    return load_model(str(demo_model), _cand(), trainable=True, quant_type="nf4")


def _linears4bit(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def test_the_decoder_linears_are_nf4_with_double_quantization_and_only_the_adapter_trains(qlora_model):
    quantized = _linears4bit(qlora_model)
    # 4 layers x (q, k, v, o, gate, up, down); lm_head (tied to the embeddings) stays as it is
    assert len(quantized) == 28 and not any("lm_head" in n for n in quantized)
    for m in quantized.values():
        state = m.weight.quant_state
        assert m.weight.dtype == torch.uint8 and state.quant_type == "nf4" and state.nested
        assert m.weight.numel() * 2 == state.shape.numel()  # two 4-bit weights per byte
    trainable = [n for n, p in qlora_model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)


def test_an_evaluation_leaves_the_4bit_weights_as_they_train(qlora_model):
    """bitsandbytes repacks a CPU weight for inference at its first no-grad eval forward (on
    AVX512-BF16 machines), after which training steps would run a kernel autograd cannot
    differentiate; memfit turns that off, so eval and train forwards compute the same logits."""
    x = torch.randint(3, 300, (2, 16))
    qlora_model.eval()
    with torch.no_grad():
        evaluated = qlora_model(input_ids=x).logits
    qlora_model.train()
    for m in _linears4bit(qlora_model).values():
        assert not getattr(m.weight.quant_state, "packing_format_for_cpu", False)
    out = qlora_model(input_ids=x, labels=x)
    torch.testing.assert_close(out.logits.detach(), evaluated, rtol=0, atol=0)
    out.loss.backward()
    # lora_B starts at zero, so it is lora_B that a first backward reaches
    grads = [p.grad for n, p in qlora_model.named_parameters() if ".lora_B." in n]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    qlora_model.zero_grad(set_to_none=True)


def test_fp4_is_a_choice_and_other_types_are_refused(demo_model):
    m = load_model(str(demo_model), _cand(), trainable=False, quant_type="fp4")
    assert {x.weight.quant_state.quant_type for x in _linears4bit(m).values()} == {"fp4"}
    with pytest.raises(ValueError, match="qlora_quant_type must be nf4 or fp4"):
        load_model(str(demo_model), _cand(), trainable=False, quant_type="int4")


def test_qlora_on_the_cpu_is_a_plan_not_a_refusal():
    assert hardware_problems(catalog.gpu("cpu"), _cand()) == []


def test_a_checkpoint_module_state_holds_the_adapter_only(qlora_model):
    trainable = {n for n, p in qlora_model.named_parameters() if p.requires_grad}
    full = qlora_model.state_dict()
    assert any(k.endswith("weight.absmax") for k in full)  # the 4-bit base writes its constants
    with adapter_only_state_dict(qlora_model):
        state = qlora_model.state_dict()
    assert set(state) == trainable
    assert set(qlora_model.state_dict()) == set(full)  # the hook is gone afterwards
    state = {k: v.clone() + 1 for k, v in state.items()}
    load_adapter_state(state, qlora_model)
    name = next(iter(state))
    torch.testing.assert_close(qlora_model.state_dict()[name], state[name])
    with pytest.raises(ValueError, match="missing .*lora"):
        load_adapter_state(dict(list(state.items())[1:]), qlora_model)
    with pytest.raises(ValueError, match="unexpected .*absmax"):
        load_adapter_state({**state, "x.weight.absmax": torch.zeros(1)}, qlora_model)
