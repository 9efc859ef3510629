"""The model a traced step runs, as memfit's trainer builds it: transformers' own class on fake
tensors at the card's width, cut to the traced layers (`build_model`: one or two decoder layers, of
each kind for a model that mixes them), LoRA applied by peft with the trainer's configuration,
gradient checkpointing and the attention kernel as the candidate sets them.
memfit.estimate.trace.trace_step traces one step of it."""

from __future__ import annotations

import dataclasses

from memfit.estimate.errors import TraceError
from memfit.estimate.models.arch import ModelArch


def build_model(
    arch: ModelArch,
    num_layers: int,
    attn: str,
    precision: str,
    grad_ckpt: bool,
    finetune: str,
    lora_rank: int = 16,
    lora_targets: tuple[str, ...] | None = None,
    shrink_config: bool = False,
):
    """The model as memfit's trainer builds it (train.py `load_model`): the HF class for the
    card with `num_layers` layers, dtype, attention, non-reentrant checkpointing and peft LoRA on
    every linear (or `lora_targets`), `enable_input_require_grads` with checkpointed LoRA.
    Call it inside a FakeTensorMode to get fake parameters."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    built = max(arch.layer_kind) + 1 if arch.layer_kind else num_layers
    try:
        cfg = dataclasses.replace(arch, num_layers=built, layer_kind=()).to_hf_config()
    except (ValueError, KeyError) as exc:
        raise TraceError(f"model {arch.name!r}: transformers cannot build it: {exc}") from None
    cfg.use_cache = False
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
    if arch.layer_kind:
        _keep_layers(model, arch, arch.layer_kind[:num_layers], built, shrink_config)
    model.train()
    if grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if finetune == "lora":
        from unittest import mock

        from peft import get_peft_model

        from memfit.train.lora import lora_config

        # The adapters in the training dtype, as DeepSpeed leaves them: its engine casts every
        # parameter to bf16/fp16 (runtime/engine.py `_configure_distributed_model` ->
        # `_cast_module_mixed_precision`), undoing peft's fp32 `autocast_adapter_dtype`. They are
        # created in that dtype directly: peft's `.to(device, dtype)` moves of fake parameters
        # fail in torch's `Module._apply` (fake parameters are always swapped, and swap_tensors
        # refuses tensors FakeTensorMode holds weakrefs to); everything is already on the CPU
        # in the right dtype, so `Module.to` is a no-op while peft injects the adapters.
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with mock.patch.object(torch.nn.Module, "to", lambda self, *a, **k: self):
                model = get_peft_model(
                    model, lora_config(model, lora_rank, targets=lora_targets), autocast_adapter_dtype=False
                )
        finally:
            torch.set_default_dtype(prev)
        if grad_ckpt:
            model.enable_input_require_grads()
    return model


def _copy(layer):
    """A copy of `layer` with new parameters and buffers made in the active (fake) mode: a plain
    deepcopy of fake tensors would give them a fake mode of their own."""
    import copy

    import torch

    memo = {id(p): torch.nn.Parameter(torch.empty_like(p), requires_grad=p.requires_grad) for p in layer.parameters()}
    memo.update({id(b): torch.empty_like(b) for b in layer.buffers()})
    return copy.deepcopy(layer, memo)


def _keep_layers(model, arch: ModelArch, ids: tuple[int, ...], built: int, shrink_config: bool) -> None:
    """Keep only decoder layers `ids` of a model built with `built` layers (one kind of layer of
    a model that mixes kinds: generic.layer_groups); an index given twice keeps a copy of that
    layer. The config stays as built: each kept layer keeps what it was built with (its
    attention type, its slice of Gemma-4's per-layer inputs), and the decoders iterate
    `self.layers[: config.num_hidden_layers]`, which now holds `len(ids)` layers. A decoder
    that indexes its layers by `range(num_hidden_layers)` (AFMoE) needs the config cut too
    (`shrink_config`: num_hidden_layers and every per-layer list follow `ids`)."""
    import torch

    from memfit.estimate.models.inventory import decoder_layers

    name, layers = decoder_layers(model, built)
    if layers is None or len(layers) != built:
        raise TraceError(f"model {arch.name!r}: no ModuleList of {built} decoder layers to trace")
    keep = [layers[i] if n == 0 or i != ids[n - 1] else _copy(layers[i]) for n, i in enumerate(ids)]
    parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    setattr(parent, name.rsplit(".", 1)[-1], torch.nn.ModuleList(keep))
    if not shrink_config:
        return
    for cfg in {id(c): c for c in (model.config, getattr(parent, "config", model.config))}.values():
        for key, value in list(vars(cfg).items()):
            if isinstance(value, list) and len(value) == built and built != len(ids):
                setattr(cfg, key, [value[i] for i in ids])
        cfg.num_hidden_layers = len(ids)
