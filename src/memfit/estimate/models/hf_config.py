"""HF config.json -> `ModelArch`: the one parser for catalog entries (config/models.yaml stores the
published config.json fields verbatim) and user-supplied config files. Each supported model_type's
defaults and bias/window rules mirror its transformers implementation; a field that changes the
weights and is not modelled is refused (`UnsupportedArchitecture`), never guessed."""

from __future__ import annotations

from dataclasses import MISSING
from typing import Any

from memfit.estimate.models.arch import ModelArch, UnsupportedArchitecture
from memfit.estimate.models.config_fields import MOE_FIELDS, check_heads, check_values
from memfit.estimate.models.generic import generic_arch
from memfit.estimate.models.hf_layouts import from_chatglm, unwrap_multimodal

# Class defaults transformers fills in when a config.json omits a field. The published Gemma-3
# 4b/12b/27b config.json files are sparse (google/gemma-3-4b-it's text_config lists only
# hidden_size, intermediate_size, num_hidden_layers, rope_scaling, sliding_window), so loading
# them needs these. Values from Gemma3TextConfig.__init__ in transformers
# (src/transformers/models/gemma3/configuration_gemma3.py); the MoE/MLA entries from
# MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig and DeepseekV3Config (configuration_*.py);
# tests/test_catalog.py checks every value against the installed transformers. Only fields
# transformers really defaults are listed: the core sizes (hidden_size, intermediate_size,
# num_hidden_layers) stay required.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {
        "vocab_size": 262208,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "attention_bias": False,
    },
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "decoder_sparse_step": 1,
        "qkv_bias": True,
    },
    "qwen3_moe": {
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "decoder_sparse_step": 1,
    },
    "deepseek_v3": {
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "first_k_dense_replace": 3,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
    },
}


# model_types whose parameter count memfit reproduces exactly (tests/test_catalog.py builds each
# with transformers on the meta device). gemma3 is the multimodal wrapper of gemma3_text.
SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3",
    "gemma3_text",
    "glm",
    "chatglm",
    "phi3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v3",
)

_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# GPT-2/GPT-J style names (modeling_gpt2: n_embd, n_layer, n_head, n_inner, n_positions).
_GPT2_FIELDS = ("n_embd", "n_layer", "n_head", "n_inner", "n_positions")
_MODELLED_FIELDS: dict[str, frozenset[str]] = {
    "mixtral": frozenset({"num_local_experts", "num_experts_per_tok"}),
    "qwen2_moe": frozenset(
        {
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "decoder_sparse_step",
            "mlp_only_layers",
        }
    ),
    "qwen3_moe": frozenset(
        {
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "decoder_sparse_step",
            "mlp_only_layers",
        }
    ),
    "deepseek_v3": frozenset(
        {
            "n_routed_experts",
            "n_shared_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "first_k_dense_replace",
            "moe_layer_freq",
            *_MLA_FIELDS,
        }
    ),
}


def _refuse_unmodelled(cfg: dict[str, Any], model_type: str, where: str) -> None:
    if model_type == "gpt2" or any(k in cfg for k in _GPT2_FIELDS):
        field = next((k for k in _GPT2_FIELDS if k in cfg), "model_type")
        raise UnsupportedArchitecture(
            f"{where}: GPT-2-style config ({field!r}; model_type {model_type or 'missing'!r}) is "
            f"not supported: GPT-2 has learned position embeddings, LayerNorm with bias, Conv1D "
            f"c_attn/c_proj/c_fc and a non-gated MLP, which memfit's estimate (Llama-style "
            f"decoders with RMSNorm and rotary positions) does not model"
        )
    if not model_type:
        raise UnsupportedArchitecture(
            f"{where}: config.json has no 'model_type', so memfit cannot tell which "
            f"implementation's weights it describes (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitecture(
            f"{where}: model_type {model_type!r} is not supported: memfit only estimates "
            f"architectures whose parameter count it reproduces exactly "
            f"({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    modelled = _MODELLED_FIELDS.get(model_type, frozenset())
    for key in (*MOE_FIELDS, *_MLA_FIELDS):
        value = cfg.get(key)
        neutral = value in (None, 0, False, []) or (key in ("decoder_sparse_step", "moe_layer_freq") and value == 1)
        if key not in modelled and not neutral:
            kind = "multi-head latent attention" if key in _MLA_FIELDS else "mixture-of-experts"
            raise UnsupportedArchitecture(
                f"{where}: {key!r} = {value!r} ({kind}) is not modelled for model_type "
                f"{model_type!r}: memfit cannot count these weights, so it refuses rather than "
                f"guessing"
            )
    if model_type == "deepseek_v3" and cfg.get("moe_layer_freq", 1) != 1:
        # transformers' DeepseekV3DecoderLayer puts experts in every layer from
        # first_k_dense_replace on; the original remote code also honoured moe_layer_freq.
        raise UnsupportedArchitecture(
            f"{where}: 'moe_layer_freq' = {cfg['moe_layer_freq']!r} is not supported (transformers' "
            f"deepseek_v3 has experts in every layer after first_k_dense_replace)"
        )


def arch_from_hf_config(cfg: dict[str, Any], name: str, where: str = "", source: str = "") -> ModelArch:
    """Build a ModelArch from the fields of a HF config.json (already parsed).

    Hand-written cards for `SUPPORTED_MODEL_TYPES`: llama, mistral, qwen2, qwen3, gemma3
    (multimodal, nested `text_config`) and gemma3_text, glm (glm-4-*-hf), chatglm (original
    THUDM field names), phi3, and the mixture-of-experts mixtral, qwen2_moe, qwen3_moe and
    deepseek_v3 (with multi-head latent attention): their formulas price a whole 72B search
    space without building anything. Every other model_type in transformers' causal-LM mapping
    (and a listed type with a field its card does not model) gets a generic card
    (memfit.estimate.models.generic): parameters from the model transformers builds, activations
    traced. Refused, naming the reason: no model_type, a type transformers does not build as a
    causal LM (or an encoder: config_fields), a config its constructor rejects, a size that is not one."""
    where = where or name
    check_values(cfg, where)  # whole positive sizes, a decoder (not BERT), or the key and value named
    model_type = str(cfg.get("model_type", "")).lower()
    if model_type == "chatglm" or (not model_type and ("padded_vocab_size" in cfg or "multi_query_group_num" in cfg)):
        return from_chatglm(cfg, name, where, source)
    raw = cfg
    try:
        cfg, model_type, vision_params = unwrap_multimodal(cfg, model_type, where)
        _refuse_unmodelled(cfg, model_type, where)
    except UnsupportedArchitecture:
        if not model_type:
            raise
        # no hand-written card for it: the parameters from transformers' own model, the
        # activations traced (memfit.estimate.models.generic)
        return generic_arch(raw, name, where, source)
    defaults = _HF_DEFAULTS.get(model_type, {})
    get = _field_getter(cfg, defaults, where)
    hidden = int(get("hidden_size"))
    heads = int(get("num_attention_heads"))
    layers = int(get("num_hidden_layers"))
    # HF (LlamaConfig, MistralConfig, Qwen2Config ...): num_key_value_heads defaults to
    # num_attention_heads (MHA) and head_dim to hidden_size // num_attention_heads.
    kv_heads = int(get("num_key_value_heads", default=heads))
    head_dim = int(get("head_dim", default=hidden // heads))
    gemma = model_type == "gemma3_text"
    qkv_bias, out_bias = _attention_biases(model_type, get)
    window = _sliding_window(model_type, cfg, get)
    pattern = None
    if gemma:
        pattern = int(get("sliding_window_pattern", default=None) or get("_sliding_window_pattern"))
    moe = _moe_fields(model_type, get, layers, where)
    if moe.get("num_experts", 0) > 0 and not 0 < moe["num_experts_per_tok"] <= moe["num_experts"]:
        raise ValueError(
            f"{where}: 'num_experts_per_tok' = {moe['num_experts_per_tok']} must be between 1 and "
            f"the number of routed experts ({moe['num_experts']})"
        )
    mla = _mla_fields(cfg, defaults, get) if model_type == "deepseek_v3" else {}
    if mla:
        # The attention's per-head query/key width; DeepseekV3Config.head_dim is the rotary part.
        head_dim = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
    return ModelArch(
        name=name,
        model_type=model_type,
        hidden_size=hidden,
        intermediate_size=int(get("intermediate_size")),
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=int(get("vocab_size")),
        max_position_embeddings=int(get("max_position_embeddings")),
        tie_word_embeddings=bool(get("tie_word_embeddings", default=False)),
        gated_mlp=True,
        attention_bias=qkv_bias,
        qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
        sliding_window=int(window) if window is not None else None,
        source=source,
        attention_out_bias=out_bias,
        mlp_bias=bool(get("mlp_bias", default=False)) if model_type == "llama" else False,
        fused_gate_up=model_type in ("glm", "phi3"),
        fused_qkv=model_type == "phi3",
        norms_per_layer=4 if gemma else 2,  # Gemma3DecoderLayer: input, post_attention,
        # pre_feedforward and post_feedforward layernorms
        sliding_window_pattern=pattern,
        vision_params=vision_params,
        **moe,
        **mla,
    )


def _field_getter(cfg: dict[str, Any], defaults: dict[str, Any], where: str) -> Any:
    """`get(key, default=MISSING)`: the config's value, else transformers' class default, else
    `default`, else a ValueError naming the file and the key."""

    def get(key: str, default: Any = MISSING) -> Any:
        if cfg.get(key) is not None:
            return cfg[key]
        if key in defaults:
            return defaults[key]
        if default is not MISSING:
            return default
        raise ValueError(f"{where}: config.json is missing {key!r} (the estimate needs it)")

    check_heads(get, where)  # key/value heads that split the query heads, a hidden size that splits
    return get


def _attention_biases(model_type: str, get: Any) -> tuple[bool, bool]:
    """(bias on q/k/v, bias on o_proj) as each transformers implementation builds them."""
    if model_type == "qwen2":
        # Qwen2 hard-codes bias=True on q/k/v and False on o_proj (modeling_qwen2.Qwen2Attention);
        # its config.json has no attention_bias field.
        qkv_bias = True
    elif model_type == "qwen2_moe":
        qkv_bias = bool(get("qkv_bias"))  # Qwen2MoeAttention: bias=config.qkv_bias on q/k/v
    else:
        qkv_bias = bool(get("attention_bias", default=False))
    # o_proj follows attention_bias in llama, qwen3, qwen3_moe and gemma3; never in qwen2,
    # qwen2_moe and glm.
    out_bias = qkv_bias and model_type not in ("qwen2", "qwen2_moe", "glm")
    if model_type in ("mistral", "mixtral", "phi3"):  # their attentions have no biases at all
        qkv_bias = out_bias = False
    return qkv_bias, out_bias


def _sliding_window(model_type: str, cfg: dict[str, Any], get: Any) -> Any:
    """The sliding window the model really uses (None: full attention)."""
    # Qwen2/Qwen3 (and their MoE) only use sliding_window when use_sliding_window is true
    # (Qwen2Config sets it to None otherwise); Mistral v0.1, Mixtral, Phi-3 and Gemma-3 use it
    # as given.
    window = get("sliding_window", default=None)
    qwen_like = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
    if model_type in qwen_like and not cfg.get("use_sliding_window", False):
        window = None
    if model_type in ("llama", "glm", "deepseek_v3"):
        window = None
    return window


def _mla_fields(cfg: dict[str, Any], defaults: dict[str, Any], get: Any) -> dict[str, int]:
    """DeepSeek-V3's multi-head latent attention sizes (DeepseekV3Config)."""
    return dict(
        # q_lora_rank null (DeepSeek-V2-Lite style): one q_proj, no query bottleneck
        q_lora_rank=int((cfg["q_lora_rank"] if "q_lora_rank" in cfg else defaults["q_lora_rank"]) or 0),
        kv_lora_rank=int(get("kv_lora_rank")),
        qk_nope_head_dim=int(get("qk_nope_head_dim")),
        qk_rope_head_dim=int(get("qk_rope_head_dim")),
        v_head_dim=int(get("v_head_dim")),
    )


def layer_mask(layers: Any) -> int:
    """The ModelArch.dense_layer_mask of a collection of layer indices."""
    return sum(1 << int(i) for i in set(layers))


def _moe_fields(model_type: str, get: Any, layers: int, where: str) -> dict[str, Any]:
    """The ModelArch MoE fields of a mixtral/qwen2_moe/qwen3_moe/deepseek_v3 config ({} else)."""
    if model_type == "mixtral":
        # MixtralDecoderLayer: every layer is a MixtralSparseMoeBlock; MixtralExperts have width
        # config.intermediate_size.
        return dict(
            num_experts=int(get("num_local_experts")),
            num_experts_per_tok=int(get("num_experts_per_tok")),
            moe_intermediate_size=int(get("intermediate_size")),
        )
    if model_type in ("qwen2_moe", "qwen3_moe"):
        # Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer: layer i has experts iff i is not in
        # mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0.
        experts, step = int(get("num_experts")), int(get("decoder_sparse_step"))
        if step <= 0:
            raise UnsupportedArchitecture(f"{where}: 'decoder_sparse_step' must be >= 1, got {step}")
        only = {int(i) for i in (get("mlp_only_layers", default=None) or [])}
        dense = tuple(i for i in range(layers) if i in only or not (experts > 0 and (i + 1) % step == 0))
        out = dict(
            num_experts=experts,
            num_experts_per_tok=int(get("num_experts_per_tok")),
            moe_intermediate_size=int(get("moe_intermediate_size")),
            dense_layer_mask=layer_mask(dense) if experts > 0 else 0,
        )
        if model_type == "qwen2_moe" and experts > 0:
            # Qwen2MoeSparseMoeBlock: shared_expert (Qwen2MoeMLP of this width) + shared_expert_gate
            out["shared_expert_intermediate_size"] = int(get("shared_expert_intermediate_size"))
            out["shared_expert_gate"] = True
        return out
    if model_type == "deepseek_v3":
        # DeepseekV3DecoderLayer: layer i >= first_k_dense_replace is a DeepseekV3MoE (routed
        # experts + shared_experts = DeepseekV3MLP of width moe_intermediate_size * n_shared_experts)
        first_k = int(get("first_k_dense_replace"))
        inter = int(get("moe_intermediate_size"))
        return dict(
            num_experts=int(get("n_routed_experts")),
            num_experts_per_tok=int(get("num_experts_per_tok")),
            moe_intermediate_size=inter,
            shared_expert_intermediate_size=inter * int(get("n_shared_experts")),
            dense_layer_mask=layer_mask(range(min(first_k, layers))),
        )
    return {}
