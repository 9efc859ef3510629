"""memfit.train.lora: the default LoRA targets are peft's all-linear less what peft cannot adapt,
for the trainer and the estimator alike (models built on the meta device: no memory, no weights)."""

from __future__ import annotations

import warnings

import pytest
import torch
from peft import get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from memfit.train.lora import lora_config, unadaptable_linears

TINY = dict(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    num_local_experts=4,
)


def meta_model(model_type: str):
    cfg = AutoConfig.for_model(model_type)
    for key, value in TINY.items():
        if hasattr(cfg, key):
            setattr(cfg, key, value)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def adapted(model) -> set[str]:
    return {n.split(".lora_A")[0] for n, _ in model.named_parameters() if ".lora_A." in n}


@pytest.mark.parametrize(
    "model_type, left_out",
    [
        ("mamba", "backbone.layers.0.mixer.out_proj"),  # peft refuses it on Mamba models
        ("llama4_text", "model.layers.0.feed_forward.router"),  # an nn.Linear returning a tuple
        ("phimoe", "model.layers.0.mlp.router"),
    ],
)
def test_the_default_leaves_out_what_plain_all_linear_cannot_adapt(model_type, left_out):
    model = meta_model(model_type)
    assert left_out in unadaptable_linears(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, lora_config(model, 8))
    names = adapted(peft_model)
    assert names and not any(left_out.split(".", 1)[1] in n for n in names)
    linears = {n for n, m in meta_model(model_type).named_modules() if isinstance(m, torch.nn.Linear)}
    # every other linear but the output head is adapted, as all-linear would
    assert {n.removeprefix("base_model.model.") for n in names} == linears - set(unadaptable_linears(model)) - {
        "lm_head"
    }


def test_a_model_peft_handles_keeps_plain_all_linear():
    model = meta_model("llama")
    assert unadaptable_linears(model) == []
    cfg = lora_config(model, 16)
    assert cfg.target_modules == "all-linear" and not cfg.exclude_modules
    assert (cfg.r, cfg.lora_alpha, cfg.lora_dropout) == (16, 32, 0.0)


def test_explicit_targets_go_to_peft_as_given():
    model = meta_model("mamba")
    cfg = lora_config(model, 8, alpha=4, targets=("in_proj", "x_proj"))
    assert set(cfg.target_modules) == {"in_proj", "x_proj"} and not cfg.exclude_modules and cfg.lora_alpha == 4
    with pytest.raises(ValueError, match="out_proj"):  # peft's own refusal stays the user's answer
        get_peft_model(model, lora_config(model, 8, targets=["out_proj"]))
