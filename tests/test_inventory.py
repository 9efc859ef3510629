"""Parameters read from transformers (memfit.estimate.models.inventory, .generic): the hand-written
cards and the model transformers builds agree for every catalog entry that has a card; LoRA
counts agree with peft applied to the whole model; mixed layer kinds are grouped as the model's
own config says."""

from __future__ import annotations

import dataclasses

import pytest

from memfit.estimate.memory.zero3 import zero3_subgroups
from memfit.estimate.models import catalog, generic, inventory, layer_counts
from memfit.estimate.models.params import _inventory_layout, param_layout, trainable_params
from memfit.estimate.settings import Settings
from memfit.space import Candidate

HAND = sorted(n for n, a in catalog.load_models().items() if not a.generic)


def _generic_twin(arch: catalog.ModelArch) -> catalog.ModelArch:
    """The generic card of the config a hand-written card describes."""
    config = arch.to_hf_config()
    return generic.generic_arch({**config.to_diff_dict(), "model_type": config.model_type}, arch.name)


@pytest.mark.parametrize("name", HAND)
def test_hand_written_cards_equal_what_transformers_builds(name):
    """The catalog's formulas and transformers' own modules: the same totals, embedding and
    head, per-layer tensors, largest gathered module, inactive experts, linears and ZeRO-3
    optimizer sub-groups."""
    arch = catalog.model(name, allow_moe=True)
    hand, built = param_layout(arch), _inventory_layout(_generic_twin(arch).inventory())
    assert (built.total, built.embed, built.lm_head) == (hand.total, hand.embed, hand.lm_head)
    assert built.per_layer == hand.per_layer and built.inactive == hand.inactive
    assert built.largest_module == hand.largest_module
    assert sorted(built.layer_tensors) == sorted(hand.layer_tensors)
    for layer in range(arch.num_layers):
        assert sorted(s[1:] for s in built.layer_linear_shapes(arch, layer)) == sorted(
            s[1:] for s in hand.layer_linear_shapes(arch, layer)
        )
    twin = _generic_twin(arch)
    # the cards order a layer's norms after its linears, transformers registers them where they
    # sit (Gemma-3's q_norm inside the attention): sub-group borders move by a few elements
    exact, approx = zero3_subgroups(twin, 8, 1_000_000_000), zero3_subgroups(arch, 8, 1_000_000_000)
    assert sum(exact) == sum(approx) and len(exact) == len(approx)
    assert all(abs(a - b) <= 1e-4 * b for a, b in zip(exact, approx, strict=True))
    assert twin.num_active_params() == arch.num_active_params()


@pytest.mark.parametrize(
    "name", ["llama-3.1-8b", "qwen2.5-7b", "glm-4-9b", "phi-3.5-mini", "gemma-3-4b", "mixtral-8x7b"]
)
def test_lora_counts_equal_the_formulas(name):
    """peft on the meta model (the generic path) and the card's r x (in + out) per linear."""
    arch = catalog.model(name, allow_moe=True)
    twin = _generic_twin(arch)
    for targets in (None, ("o_proj", "down_proj")):
        cand = Candidate(finetune="lora", lora_rank=16)
        settings = Settings(lora_targets=targets)
        assert trainable_params(twin, cand, settings) == trainable_params(arch, cand, settings), targets


TINY_MOE = {
    "qwen3_next": {"model_type": "qwen3_next", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
                   "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                   "linear_key_head_dim": 16, "linear_value_head_dim": 16},
    "deepseek_v3": {"model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
                    "num_attention_heads": 4, "vocab_size": 256, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32, "first_k_dense_replace": 1, "q_lora_rank": 32, "kv_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "n_group": 1, "topk_group": 1,
                    "max_position_embeddings": 512},
    "mixtral": {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "num_local_experts": 4,
                "num_experts_per_tok": 2},
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(TINY_MOE))
def test_lora_count_of_moe_models_equals_peft_on_the_whole_model(kind):
    """peft on the first layer of each kind, multiplied out: what peft adds to the whole model
    (DeepSeek: its dense layer's MLP is not adapted, the MoE layers' experts are)."""
    import json

    cfg = TINY_MOE[kind]
    text = json.dumps(cfg, sort_keys=True)
    layers = cfg["num_hidden_layers"]
    for targets in (None, ("o_proj",)):
        per_layer, outside, _ = layer_counts._peft_params(inventory.config_from_dict(cfg), 8, targets, layers)
        assert layer_counts.lora_params(text, 8, targets) == sum(per_layer) + outside


def test_layer_kinds_follow_layer_types_and_experts():
    """gpt-oss alternates sliding and full attention; DeepSeek's first layer is dense: each kind
    is traced on its own, from two layers of it."""
    oss = catalog.arch_from_hf_config({**TINY_MOE["mixtral"], "model_type": "gpt_oss", "num_hidden_layers": 4,
                                       "head_dim": 16, "sliding_window": 8}, name="oss")  # fmt: skip
    groups = generic.layer_groups(oss)
    assert [(n, label) for n, _, label in groups] == [(2, "sliding_attention MoE"), (2, "full_attention MoE")]
    assert [card.layer_kind for _, card, _ in groups] == [(0, 2), (1, 3)]
    ds = catalog.arch_from_hf_config(TINY_MOE["deepseek_v3"], name="ds")
    assert not ds.generic  # a hand-written card; the estimate swaps MLA for the generic twin
    groups = generic.layer_groups(_generic_twin(ds))
    assert [(n, card.layer_kind) for n, card, _ in groups] == [(1, (0, 0)), (2, (1, 2))]


def test_inventory_is_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv(inventory.ENV_CACHE, str(tmp_path))
    cfg = dict(TINY_MOE["mixtral"], num_hidden_layers=3)
    arch = catalog.arch_from_hf_config({**cfg, "model_type": "gpt_oss", "head_dim": 16}, name="c")
    files = sorted(p.name.split("-")[0] for p in (tmp_path / "inventory").iterdir())
    assert files == ["card", "inventory"]
    inventory.inventory.cache_clear()
    assert dataclasses.replace(arch).inventory().total == arch.num_params()


@pytest.mark.parametrize("finetune, grad_ckpt", [("full", False), ("lora", True)])
def test_traced_flops_agree_with_the_formula_on_a_dense_model(tmp_path, finetune, grad_ckpt):
    """FlopCounterMode on the traced step of the generic twin against 6 (LoRA: 4) FLOPs per
    parameter per token plus attention (Kaplan et al. 2020; costs.step_flops), with and
    without the recomputation checkpointing adds."""
    from memfit.estimate.time.costs import step_flops

    arch = catalog.model("llama-3.2-1b")
    twin = _generic_twin(arch)
    cand = Candidate(seq_len=256, micro_batch=1, finetune=finetune, lora_rank=8, grad_ckpt=grad_ckpt, attn="sdpa")
    settings = Settings(trace_cache=str(tmp_path))
    for recompute in (True, False):
        traced = step_flops(twin, cand, "sft", recompute=recompute, settings=settings)
        formula = step_flops(arch, cand, "sft", recompute=recompute)
        assert traced == pytest.approx(formula, rel=0.05), (recompute, traced / formula)
