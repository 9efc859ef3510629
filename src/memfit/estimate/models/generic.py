"""A `ModelArch` card for any model_type transformers builds as a causal LM (`generic_arch`): the
sizes the time and activation terms name (hidden, layers, heads, vocabulary) read from the
transformers config object, the parameters from the model itself (memfit.estimate.models.inventory),
the activations from a traced step (memfit.estimate.trace.trace). Multimodal wrappers (a config with
a `text_config`) are estimated on their text model; the rest of the checkpoint (vision tower,
projector) is counted and reported as `vision_params`, as for the hand-written Gemma-3 card."""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from memfit.estimate.models import inventory
from memfit.estimate.models.arch import ModelArch, UnsupportedArchitecture

# Names transformers' configs give the context length (LlamaConfig max_position_embeddings,
# GPT2Config n_positions, BloomConfig/MPT max_seq_len ...).
_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "max_seq_len", "seq_length")


def _first_int(config: Any, names: tuple[str, ...], default: int = 0) -> int:
    for n in names:
        try:
            v = getattr(config, n, None)
        except Exception:  # noqa: BLE001 - Gemma-4: a per-layer-type field has no one value
            v = None
        if isinstance(v, list) and v and all(isinstance(x, int) for x in v):
            v = max(v)  # per-layer widths (Gemma-3n intermediate_size): the widest
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return default


def _causal_lm_types() -> frozenset[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _check_causal_lm(model_type: str, where: str) -> None:
    if model_type not in _causal_lm_types():
        raise UnsupportedArchitecture(
            f"{where}: model_type {model_type or 'missing'!r} is not in transformers' "
            f"AutoModelForCausalLM mapping (transformers {inventory.transformers_version()}), so "
            f"memfit cannot build or train it"
        )


def generic_arch(cfg: dict[str, Any], name: str, where: str = "", source: str = "") -> ModelArch:
    """The card of a config.json whose model_type memfit has no hand-written card for. Its
    fields are cached with the inventory (`inventory.cached`): a cache hit imports no
    transformers code, so the catalog's flagship entries load in milliseconds."""
    where = where or name
    if not isinstance(cfg.get("text_config"), dict):
        _check_causal_lm(str(cfg.get("model_type", "") or ""), where)
    text = json.dumps(cfg, sort_keys=True, default=str)
    fields = inventory.cached("card", text, lambda: _card_fields(cfg, where))
    return ModelArch(name=name, source=source, **fields)


def _card_fields(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    config = inventory.config_from_dict(cfg, where)
    text = config.get_text_config()
    text_dict = dict(cfg)
    if text is not config:  # a multimodal wrapper: its text model is what the estimate prices
        text_dict = {k: v for k, v in text.to_dict().items() if not k.startswith("_")}
    _check_causal_lm(str(text_dict.get("model_type", "") or ""), where)
    canonical = json.dumps(text_dict, sort_keys=True, default=str)
    inv = inventory.inventory(canonical, where)
    vision_params = 0
    if text is not config:
        vision_params = max(0, inventory.wrapper_params(config, where) - inv.total)
    text = inventory.config_from_dict(json.loads(canonical), where)
    hidden = _first_int(text, ("hidden_size", "d_model", "n_embd"))
    heads = _first_int(text, ("num_attention_heads", "n_head", "num_heads"), default=1)
    if not hidden:
        raise UnsupportedArchitecture(f"{where}: the config names no hidden size (hidden_size)")
    moe_layers = {m.layer for m in inv.modules if m.expert and m.layer is not None}
    dense_mask = 0
    if inv.num_experts:
        for i in range(inv.num_layers):
            if i not in moe_layers:
                dense_mask |= 1 << i
    window = getattr(text, "sliding_window", None)
    return dict(
        model_type=str(text.model_type),
        hidden_size=hidden,
        intermediate_size=_first_int(text, ("intermediate_size", "n_inner", "ffn_hidden_size"), default=4 * hidden),
        num_layers=inv.num_layers,
        num_attention_heads=heads,
        num_kv_heads=_first_int(text, ("num_key_value_heads", "num_kv_heads"), default=heads),
        head_dim=_first_int(text, ("head_dim",), default=max(1, hidden // heads)),
        vocab_size=inv.embed // hidden if inv.embed else _first_int(text, ("vocab_size",)),
        max_position_embeddings=_first_int(text, _CONTEXT_FIELDS),
        tie_word_embeddings=inv.tied,
        sliding_window=window if isinstance(window, int) and window > 0 else None,
        vision_params=vision_params,
        num_experts=inv.num_experts,
        num_experts_per_tok=inv.experts_per_token,
        moe_intermediate_size=_first_int(text, ("moe_intermediate_size", "expert_intermediate_size")),
        dense_layer_mask=dense_mask,
        hf_config=canonical,
    )


@functools.lru_cache(maxsize=256)
def layer_groups(arch: ModelArch) -> tuple[tuple[int, ModelArch, str], ...]:
    """The kinds of decoder layer a model mixes, each as (how many, a card standing for that
    kind, its label): layers differ when their `config.layer_types` entries differ (sliding vs
    full attention, linear attention, Mamba vs attention ...) or their parameter-owning modules
    do (MoE vs dense MLP, a layer without attention: the inventory). The trace measures each
    kind on its own: the card's `layer_kind` names two layers of it, and the traced model keeps
    only those (trace_model.build_model). `((L, arch, ""),)` when every layer is alike."""
    if not arch.generic or arch.layer_kind:
        return ((arch.num_layers, arch, ""),)
    inv = arch.inventory()
    types = getattr(inventory.config_from_dict(json.loads(arch.hf_config), arch.name), "layer_types", None)
    types = list(types) if isinstance(types, list) and len(types) == arch.num_layers else None
    kinds = inv.layer_kinds(types)
    if len(kinds) == 1:
        return ((arch.num_layers, arch, ""),)
    groups = []
    for ids in kinds:
        experts = any(m.expert for m in inv.layer_modules(ids[0]))
        kind = types[ids[0]] if types else ""
        label = " ".join(x for x in (str(kind), "MoE" if experts else "") if x) or f"like layer {ids[0]}"
        pair = (ids[0], ids[1] if len(ids) > 1 else ids[0])
        groups.append((len(ids), dataclasses.replace(arch, layer_kind=pair), label))
    return tuple(groups)
