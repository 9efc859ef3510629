"""The architecture card as a transformers config: which transformers implementation matches a
card (`hf_model_type`) and its `PretrainedConfig` (`to_hf_config`), from which the tracer,
the inventory and the tests build the model itself on the meta device or on fake tensors.
`ModelArch.to_hf_config()` and `ModelArch.hf_model_type` answer from here."""

from __future__ import annotations

from typing import Any

from memfit.estimate.errors import UnsupportedArchitecture

# model_types whose transformers implementation the card (memfit.estimate.models.arch) mirrors exactly.
_HF_IMPLEMENTED = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3_text",
    "glm",
    "phi3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v3",
)


def hf_model_type(arch: Any) -> str:
    """The transformers model_type whose implementation matches this card."""
    if arch.model_type in _HF_IMPLEMENTED:
        return arch.model_type
    if arch.model_type == "chatglm":
        # transformers has no chatglm; GlmForCausalLM is its port with identical parameter
        # counts (convert_glm_weights_to_hf.py splits query_key_value into q/k/v).
        return "glm"
    if arch.qk_norm:
        return "qwen3"
    if arch.attention_bias and not arch.attention_out_bias:
        return "qwen2"
    return "llama"


def _generic_hf_config(arch: Any) -> Any:
    import json

    from memfit.estimate.models import inventory

    config = inventory.config_from_dict(json.loads(arch.hf_config), arch.source or arch.name)
    return inventory.with_layers(config, arch.num_layers)


def to_hf_config(arch: Any) -> Any:
    """A `transformers.PretrainedConfig` for this architecture (AutoConfig.for_model).

    Build the model without allocating: `with torch.device("meta"):
    AutoModelForCausalLM.from_config(arch.to_hf_config())`. Multimodal Gemma-3 cards give the
    text-only `gemma3_text` config (Gemma3ForCausalLM). Generic cards: their own config.json
    with `num_layers` layers (`inventory.with_layers`).
    """
    from transformers import AutoConfig  # heavy import, only when asked

    if arch.generic:
        return _generic_hf_config(arch)

    mt = hf_model_type(arch)
    kwargs: dict[str, Any] = dict(
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        vocab_size=arch.vocab_size,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
        pad_token_id=None,  # class defaults (GLM's 151329) can exceed a small vocabulary
    )
    if mt in ("llama", "qwen3", "glm", "gemma3_text", "qwen3_moe", "deepseek_v3"):
        kwargs["attention_bias"] = arch.attention_bias
    if mt == "llama":
        kwargs["mlp_bias"] = arch.mlp_bias
    if mt in ("mistral", "gemma3_text", "mixtral", "phi3") and arch.sliding_window is not None:
        kwargs["sliding_window"] = arch.sliding_window
    if mt == "gemma3_text" and arch.sliding_window_pattern is not None:
        kwargs["sliding_window_pattern"] = arch.sliding_window_pattern
    if mt in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        kwargs["use_sliding_window"] = arch.sliding_window is not None
        kwargs["sliding_window"] = arch.sliding_window
    if mt == "mixtral":  # MixtralConfig: intermediate_size is the expert width
        kwargs.update(
            intermediate_size=arch.moe_intermediate_size,
            num_local_experts=arch.num_experts,
            num_experts_per_tok=arch.num_experts_per_tok,
        )
    if mt in ("qwen2_moe", "qwen3_moe"):
        kwargs.update(
            num_experts=arch.num_experts,
            num_experts_per_tok=arch.num_experts_per_tok,
            moe_intermediate_size=arch.moe_intermediate_size,
            decoder_sparse_step=1,
            mlp_only_layers=list(arch.dense_layers),
        )
    if mt == "qwen2_moe":
        kwargs.update(
            qkv_bias=arch.attention_bias,
            shared_expert_intermediate_size=arch.shared_expert_intermediate_size,
        )
    if mt == "deepseek_v3":
        k = len(arch.dense_layers)
        if arch.dense_layers != tuple(range(k)):
            raise UnsupportedArchitecture(
                f"{arch.name}: deepseek_v3 has dense layers only as a prefix "
                f"(first_k_dense_replace), not {list(arch.dense_layers)}"
            )
        del kwargs["head_dim"]  # DeepseekV3Config derives it (qk_rope_head_dim)
        kwargs.update(
            n_routed_experts=arch.num_experts,
            num_experts_per_tok=arch.num_experts_per_tok,
            moe_intermediate_size=arch.moe_intermediate_size,
            n_shared_experts=arch.shared_expert_intermediate_size // arch.moe_intermediate_size,
            first_k_dense_replace=k,
            q_lora_rank=arch.q_lora_rank or None,
            kv_lora_rank=arch.kv_lora_rank,
            qk_nope_head_dim=arch.qk_nope_head_dim,
            qk_rope_head_dim=arch.qk_rope_head_dim,
            v_head_dim=arch.v_head_dim,
            n_group=1,  # expert groups only change routing, not shapes
            topk_group=1,
        )
    return AutoConfig.for_model(mt, **kwargs)
