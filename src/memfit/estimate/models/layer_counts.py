"""Parameter counts measured on the model transformers builds, cut to the first layer of each
kind (`Inventory.layer_kinds`) and multiplied out over every layer: what peft's LoRA adds
(`lora_params`), the parameters peft parametrizes on an MoE model's experts
(`lora_parametrized_numel`, `lora_adapts_experts`) and those that get no gradient in a training
step (`ungraded_params`). Each is cached with the inventory (memfit.estimate.models.inventory
`cached`): peft's import and a meta build cost seconds per process."""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

from memfit.estimate.errors import UnsupportedArchitecture
from memfit.estimate.models.inventory import (
    build_meta,
    cached,
    config_from_dict,
    decoder_layers,
    inventory,
    with_layers,
)


@functools.lru_cache(maxsize=256)
def lora_params(config_json: str, rank: int, targets: tuple[str, ...] | None) -> int:
    """Parameters peft adds with LoraConfig(r=rank, target_modules=targets or "all-linear" less the
    linears it cannot adapt: memfit.train.lora).

    Counted by applying peft to the meta model cut to the first layer of each kind (layers
    whose parameter-owning modules differ: dense vs MoE, attention vs linear attention ...),
    per layer, then multiplied out: peft decides per module from its name and class, so every
    layer of a kind gets the same adapters, and what it does on an MoE model is its own rule
    (peft >= 0.18 maps "all-linear" onto the routed experts' 3D parameters and leaves, e.g.,
    DeepSeek's dense gate/up/down_proj alone). tests/test_inventory.py checks the count against
    peft on the whole model."""

    def count() -> int:
        return _per_kind(config_json, lambda config, upto: _peft_params(config, rank, targets, upto)[:2])

    # cached with the inventory: peft's import and a meta build cost seconds per process
    return int(cached("lora", f"{rank}|{list(targets) if targets else None}|{config_json}", count))


@functools.lru_cache(maxsize=64)
def ungraded_params(config_json: str) -> int:
    """Parameters that get no gradient in a training step (`ungraded_numel`), measured
    on the model cut to the first layer of each kind and multiplied out as `lora_params` is;
    cached with the inventory. Full fine-tuning keeps gradients and AdamW states for the rest."""

    def measure() -> int:
        try:
            return _per_kind(config_json, ungraded_numel)
        except Exception:  # noqa: BLE001 - a model whose step does not run on fake tensors:
            return 0  # every parameter counted as trained (the larger estimate)

    return int(cached("ungraded", config_json, measure))


def _per_kind(config_json: str, measure: Any) -> int:
    """`measure(config, layers) -> (per decoder layer, outside the layers)` on the model cut to
    the first layer of each kind (`Inventory.layer_kinds`), multiplied out over every layer."""
    kinds = inventory(config_json).layer_kinds()
    upto = max(ids[0] for ids in kinds) + 1
    per_layer, outside = measure(with_layers(config_from_dict(json.loads(config_json)), upto), upto)
    return outside + sum(len(ids) * per_layer[ids[0]] for ids in kinds)


@functools.lru_cache(maxsize=64)
def lora_adapts_experts(config_json: str) -> bool:
    """Whether peft's "all-linear" puts adapters on the routed experts of this model (peft maps
    them for the types transformers' weight conversion knows: `target_parameters`)."""
    return lora_parametrized_numel(config_json) > 0


@functools.lru_cache(maxsize=64)
def lora_parametrized_numel(config_json: str) -> int:
    """Elements of the parameters peft's "all-linear" parametrizes in one MoE layer (peft
    ParamWrapper, `target_parameters`: the experts' 3D weights, the router's): each forward
    builds W + BA as a new tensor of that size, which the layer keeps for its backward. 0 where
    peft adapts nn.Linear modules only."""

    def count() -> int:
        inv = inventory(config_json)
        moe = sorted({m.layer for m in inv.modules if m.expert and m.layer is not None})
        if not moe:
            return 0
        config = with_layers(config_from_dict(json.loads(config_json)), moe[0] + 1)
        return _peft_params(config, 8, None, moe[0] + 1)[2]

    return int(cached("wrapped", config_json, count))


def _peft_params(config: Any, rank: int, targets: tuple[str, ...] | None, layers: int) -> tuple[list[int], int, int]:
    """What peft's get_peft_model adds to the meta model of `config`: per decoder layer, outside
    the layers, and the elements of the parameters it parametrizes (ParamWrapper) in the last
    layer."""
    import warnings

    from peft import get_peft_model

    from memfit.train.lora import lora_config

    model = build_meta(config)
    before = sum(p.numel() for p in model.parameters())
    lora = lora_config(model, rank, targets=targets)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft_model = get_peft_model(model, lora)
    except ValueError as exc:  # peft names the target it did not find
        raise UnsupportedArchitecture(f"LoRA targets {targets or 'all-linear'} on {config.model_type}: {exc}") from None
    added = sum(p.numel() for p in peft_model.parameters()) - before
    _, decoder = decoder_layers(peft_model, layers)
    per_layer = [sum(p.numel() for n, p in layer.named_parameters() if "lora_" in n) for layer in decoder]
    from peft.tuners.lora.layer import ParamWrapper

    wrapped = sum(m.get_param().numel() for m in decoder[-1].modules() if isinstance(m, ParamWrapper))
    return per_layer, int(added - sum(per_layer)), int(wrapped)


def ungraded_numel(config: Any, layers: int) -> tuple[list[int], int]:
    """Elements of the parameters that get no gradient in a causal-LM training step (forward on
    input ids, loss, backward), measured on fake tensors for `config` with `layers` layers: per
    decoder layer, and outside the layers. A decoder built for cross-attention (BART-style
    ForCausalLM) never runs its cross-attention without encoder states, so its weights get no
    gradient and AdamW keeps no state for them."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from memfit.estimate.models.fake_mode import grouped_mm_for_fake

    config = copy.deepcopy(config)
    config.use_cache = False
    with FakeTensorMode(), grouped_mm_for_fake(True):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.train()
        vocab = model.get_input_embeddings().weight.shape[0]
        ids = torch.randint(0, vocab, (2, 16))
        model(input_ids=ids, use_cache=False).logits.float().sum().backward()
        _, stack = decoder_layers(model, layers)
        per_layer = [sum(p.numel() for p in layer.parameters() if p.grad is None) for layer in stack]
        total = sum(p.numel() for p in model.parameters() if p.grad is None)
    return per_layer, int(total - sum(per_layer))
