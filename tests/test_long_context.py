"""DeepSpeed ALST's layer levers (memfit.train.long_context): the tiled MLP computes what the
model's own MLP computes while holding a tile's intermediates, the activation offload reaches
DeepSpeed's hooks (and moves nothing on the CPU), and the estimator prices both."""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import pytest
import torch

from memfit.space import Candidate, engine_key


def _model(demo_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32)
    model.train()
    return model


def _step(model, ids, count: bool = True) -> tuple[float, int, dict[str, torch.Tensor]]:
    """Loss, the bytes of the activations autograd saved (each storage once, weights left out),
    and the gradients of one forward and backward. `count=False`: no hooks of its own (saved-tensor
    hooks do not nest: the innermost alone packs)."""
    weights = {p.data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        if t.data_ptr() not in weights:
            saved[t.data_ptr()] = max(saved.get(t.data_ptr(), 0), t.untyped_storage().nbytes())
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if count else contextlib.nullcontext()
    with hooks:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss.detach()), sum(saved.values()), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_tiled_mlp_trains_what_the_mlp_does_and_saves_only_its_input(demo_model):
    from memfit.train.long_context import tile_mlps

    torch.manual_seed(0)
    plain = _model(demo_model)
    tiled = copy.deepcopy(plain)
    assert tile_mlps(tiled, tile_tokens=5) == plain.config.num_hidden_layers
    ids = torch.randint(0, plain.config.vocab_size, (2, 37))  # 8 tiles of 74 rows: padded to 80
    loss_a, saved_a, grads_a = _step(plain, ids)
    loss_b, saved_b, grads_b = _step(tiled, ids)
    assert loss_b == pytest.approx(loss_a, rel=1e-6)
    assert max(float((grads_a[n] - grads_b[n]).abs().max()) for n in grads_a) < 1e-6
    # per layer the MLP's gate, up, act(gate) and product (4 x intermediate per token) are not
    # saved; the tiled MLP keeps its padded input (3 zero rows more) in their place
    c, tokens = plain.config, ids.numel()
    expected = c.num_hidden_layers * 4 * (4 * tokens * c.intermediate_size - 4 * 3 * c.hidden_size)
    assert saved_a - saved_b == pytest.approx(expected, rel=0.02)


def test_the_tiled_mlp_refuses_experts():
    from types import SimpleNamespace

    from transformers.modeling_layers import GradientCheckpointingLayer

    from memfit.train.long_context import tile_mlps

    layer = GradientCheckpointingLayer()
    layer.mlp = torch.nn.Module()
    layer.mlp.experts = torch.nn.ModuleList()
    model = torch.nn.Sequential(layer)
    model.config = SimpleNamespace(hidden_size=8)
    with pytest.raises(ValueError, match="tiles dense MLPs; Module routes tokens to experts"):
        tile_mlps(model)


def test_activation_offload_marks_the_checkpointed_inputs_and_moves_nothing_on_the_cpu(demo_model):
    from memfit.train.long_context import activation_offload

    torch.manual_seed(0)
    model = _model(demo_model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    loss_a, _, grads_a = _step(model, ids)
    model.zero_grad()
    offload = activation_offload(Candidate(grad_ckpt=True, activation_offload=True))
    with offload:
        loss_b, _, grads_b = _step(model, ids, count=False)
    assert loss_b == loss_a and all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    # DeepSpeed's hooks saw every decoder layer's checkpointed input; its CPU accelerator has no
    # streams, so every one was skipped (offload_activations.py `_should_skip`), none faked
    layers = model.config.num_hidden_layers
    assert offload.stats.marked_tensors == layers
    assert offload.stats.skipped_marked_tensors == layers and offload.stats.offloaded_tensors == 0


def test_the_levers_name_themselves_and_need_what_they_move():
    c = Candidate(grad_ckpt=True, tiled_mlp=True, activation_offload=True, sequence_parallel=2)
    assert c.id.endswith("-sp2-tmlp-aoff")
    assert engine_key(c).endswith("|sequence_parallel=2|tiled_mlp=True|activation_offload=True")
    assert engine_key(Candidate()) == engine_key(Candidate(tiled_mlp=False))  # old keys unchanged
    with pytest.raises(ValueError, match="activation_offload needs grad_ckpt"):
        Candidate(activation_offload=True)


# --------------------------------------------------------------------------- the estimator
LONG = Candidate(zero=3, attn="flash", grad_ckpt=True, seq_len=65536, loss_impl="chunked", offload_optimizer="cpu")


def _llama(cand: Candidate, gpu: str = "h100-80gb"):
    from memfit.estimate import estimate
    from memfit.estimate.models import catalog

    return estimate(catalog.model("llama-3.1-8b"), catalog.gpu(gpu), 8, 1, "sft", cand)


def test_the_estimator_holds_a_tile_of_the_mlp_and_recomputes_it():
    from memfit.estimate.models import catalog
    from memfit.estimate.time.costs import step_flops

    plain, tiled = _llama(LONG), _llama(dataclasses.replace(LONG, tiled_mlp=True))
    # at the top layer's backward: the other layers' checkpointed inputs, and in the top layer
    # one tile's intermediates instead of 65,536 tokens x 14,336 x 2 bytes several times
    assert tiled.breakdown["activations"] < 0.75 * plain.breakdown["activations"]
    arch = catalog.model("llama-3.1-8b")
    extra = step_flops(arch, dataclasses.replace(LONG, tiled_mlp=True), "sft") - step_flops(arch, LONG, "sft")
    assert extra == 2 * 32 * 3 * 4096 * 14336 * 65536  # one more MLP forward per layer
    moe = _estimate_moe(dataclasses.replace(LONG, tiled_mlp=True))
    assert moe.invalid and "tiled_mlp is modelled for dense MLPs" in moe.reason


def _estimate_moe(cand):
    from memfit.estimate import estimate
    from memfit.estimate.models import catalog

    return estimate(catalog.model("mixtral-8x7b", allow_moe=True), catalog.gpu("h100-80gb"), 8, 1, "sft", cand)


def test_the_estimator_moves_checkpointed_inputs_to_pinned_host_memory():
    plain, off = _llama(LONG), _llama(dataclasses.replace(LONG, activation_offload=True))
    per_input = 2 * 65536 * 4096  # bf16 hidden states of one layer's input: 512 MiB
    # all but three leave the device (the newest and the two whose copies are in flight)
    assert plain.breakdown["activations"] - off.breakdown["activations"] == 29 * per_input
    # every input but the newest sits in a pinned host buffer, 8 ranks per node
    assert off.host_breakdown["offloaded_activations"] == 8 * 31 * per_input
    assert off.host_bytes - plain.host_bytes == 8 * 31 * per_input
    # the copies overlap compute: 2 x 31 x 512 MiB over PCIe Gen5 (64 GB/s) take less than the compute
    assert off.time_breakdown["offload"] == plain.time_breakdown["offload"]
    cpu = _llama(
        dataclasses.replace(LONG, zero=2, offload_optimizer="none", attn="sdpa", activation_offload=True), "cpu"
    )
    assert any("moves nothing: the host is the device" in n for n in cpu.notes)
