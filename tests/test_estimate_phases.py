"""Phases and the peak's breakdown (memfit.estimate.memory.phases): the breakdown accounts for every
byte of the peak, and the peak is the largest phase."""

from __future__ import annotations

import dataclasses

import pytest

from memfit.estimate import DEFAULT_SETTINGS, NCCL_CUMEM_BYTES, EstimateError, Settings, estimate, estimate_space
from memfit.estimate.memory import allocator
from memfit.estimate.models import catalog
from memfit.space import Candidate, enumerate_space

AXES = {
    "zero": [0, 1, 2, 3],
    "grad_ckpt": [False, True],
    "attn": ["sdpa", "eager"],
    "finetune": ["full", "lora", "qlora"],
    "grad_accum": [1, 4],
    "seq_len": [512, 4096],
}


@pytest.mark.parametrize(
    "model,gpu,method,logits_handling",
    [
        ("llama-3.1-8b", "a100-80gb", "sft", "memfit"),
        ("glm-4-9b", "h100-80gb", "dpo", "memfit"),
        ("gemma-3-4b", "rtx4090", "dpo", "memfit"),
        ("llama-3.1-8b", "a100-80gb", "sft", "hf-loss-function"),
        ("llama-3.1-8b", "rtx4090", "sft", "torchtune-held"),
    ],
)
def test_breakdown_sums_to_the_peak_and_the_peak_is_the_largest_phase(model, gpu, method, logits_handling):
    cands = list(enumerate_space(AXES, {"ref": "model" if method == "dpo" else "precomputed"}))
    settings = dataclasses.replace(DEFAULT_SETTINGS, logits_handling=logits_handling)
    rows = estimate_space(catalog.model(model), catalog.gpu(gpu), 4, 1, method, cands, settings=settings)
    phases_seen = set()
    for row in rows:
        if row["invalid"]:
            continue
        parts = row["breakdown"]
        assert sum(parts.values()) == row["device_total_bytes"], row["id"]
        assert row["device_total_bytes"] - parts["overheads"] == row["peak_allocated_bytes"], row["id"]
        assert all(v >= 0 for v in parts.values()), (row["id"], parts)
        assert row["phases"][row["peak_phase"]] == max(row["phases"].values()) == row["peak_allocated_bytes"]
        phases_seen.add(row["peak_phase"])
    # the space is varied enough that the peak is not always in the same phase
    assert len(phases_seen) >= 2, phases_seen


def _est(settings=DEFAULT_SETTINGS, gpu="a100-80gb", num_gpus=1, **cand):
    c = Candidate(**{"finetune": "lora", "seq_len": 4096, "grad_ckpt": True, **cand})
    return estimate(catalog.model("llama-3.1-8b"), catalog.gpu(gpu), num_gpus, 1, "sft", c, settings=settings)


def test_another_trainers_logits_handling_adds_only_its_own_tensors():
    """memfit's own trainer (the default) frees the model output before backward; the
    transformers >= 4.46 loss function holds 2 t V more at the loss forward (bf16), torchtune's
    recipes 4 t V through the backward; transformers <= 4.45 no more than memfit."""
    tv = 4096 * catalog.model("llama-3.1-8b").vocab_size
    own = _est()
    assert "loss_forward" not in own.phases
    hf = _est(Settings(logits_handling="hf-loss-function"))
    assert hf.phases["loss_forward"] == own.phases["loss_backward"] + 2 * tv
    assert hf.peak_phase == "loss_forward" and hf.breakdown["logits"] == 14 * tv
    tt = _est(Settings(logits_handling="torchtune-held"))
    for k in ("forward", "loss_backward", "top_layer_backward", "optimizer_step"):
        assert tt.phases[k] == own.phases[k] + 4 * tv, k
    old = _est(Settings(logits_handling="hf-model-fp32"))
    assert old.phases == own.phases
    with pytest.raises(EstimateError, match="logits_handling"):
        _est(Settings(logits_handling="keras"))
    with pytest.raises(EstimateError, match="chunked"):
        _est(Settings(logits_handling="torchtune-held"), loss_impl="chunked")


def test_gpu_only_terms_stay_off_the_cpu_device():
    """The cached fp32 logits block and NCCL are GPU terms: the cpu device (no caching
    allocator, gloo) is estimated as before; on a GPU the block is 4 t V (one chunk's with the
    chunked loss), of which the allocator's default share stays cached (memfit.estimate.memory.allocator,
    issue #42), and NCCL's communicator is counted for world > 1."""
    V = catalog.model("llama-3.1-8b").vocab_size
    cpu = _est(gpu="cpu", num_gpus=2, seq_len=256)
    assert cpu.peak_reserved_bytes == cpu.peak_allocated_bytes == cpu.device_total_bytes
    one = _est(Settings(variable_length=False))
    two = _est(Settings(variable_length=False), num_gpus=2)
    assert two.device_total_bytes - two.peak_reserved_bytes == (
        one.device_total_bytes - one.peak_reserved_bytes + NCCL_CUMEM_BYTES
    )
    frag = one.peak_reserved_bytes - one.peak_allocated_bytes
    exp = _est(Settings(variable_length=False, expandable_segments=True))
    share = allocator.LOGITS_CACHED_SHARE
    assert frag - (exp.peak_reserved_bytes - exp.peak_allocated_bytes) >= share * 4 * 4096 * V
    chunked = _est(Settings(variable_length=False, loss_chunk_tokens=512), loss_impl="chunked")
    assert chunked.peak_reserved_bytes - chunked.peak_allocated_bytes <= frag - share * 4 * (4096 - 512) * V


def test_qlora_counts_one_dequantized_weight():
    """bitsandbytes' MatMul4Bit dequantizes the whole weight (16-bit) in the forward: the largest
    MLP linear of llama-3.1-8b (14336 x 4096) on top of what LoRA holds there. In the backward the
    weight is freed before the adapter's input gradient is summed with the base one, the moment a
    LoRA layer peaks (3 t*in*d), so the layer rises by w - 2 t*in*d (gate/up: in = h)."""
    lora = _est(finetune="lora", seq_len=512)
    q = _est(finetune="qlora", seq_len=512)
    arch = catalog.model("llama-3.1-8b")
    w = 2 * arch.hidden_size * arch.intermediate_size
    t = 512  # micro batch 1 (the Candidate default) x seq_len
    lora_static, q_static = lora.phases["resume"], q.phases["resume"]
    assert q.phases["forward"] - q_static == lora.phases["forward"] - lora_static + w
    rise = w - 2 * t * arch.hidden_size * 2
    assert q.phases["top_layer_backward"] - q_static == lora.phases["top_layer_backward"] - lora_static + rise


@pytest.mark.parametrize(
    ("zero", "offload", "held_per_param"), [(0, "none", 2.0), (1, "none", 2.0), (2, "none", 2.0 / 8), (2, "cpu", 0.0)]
)
def test_accumulated_gradients_are_held_into_the_next_micro_step(zero, offload, held_per_param):
    """From the second micro step on, ZeRO-0/1 hold every bf16 gradient and ZeRO-2 its partition's
    (8 ranks) beside the forward; with the optimizer offloaded DeepSpeed accumulates on the host."""
    arch, gpu = catalog.model("llama-3.1-8b"), catalog.gpu("a100-80gb")
    one = Candidate(zero=zero, offload_optimizer=offload, grad_accum=1, seq_len=2048)
    e1 = estimate(arch, gpu, 8, 1, "sft", one)
    e2 = estimate(arch, gpu, 8, 1, "sft", dataclasses.replace(one, grad_accum=2))
    held = e2.phases["forward"] - e1.phases["forward"]
    assert held == pytest.approx(held_per_param * e1.params_trainable, rel=1e-6, abs=8)
