"""config.json layouts beside transformers' usual one, read into the same card: the original
THUDM ChatGLM/GLM-4 config (`from_chatglm`: ChatGLMConfig's own field names) and a multimodal
wrapper (`unwrap_multimodal`: Gemma-3 nests its language model in text_config; its SigLIP vision
tower and projector are counted exactly, `gemma3_vision_params`, not modelled).
memfit.estimate.models.hf_config dispatches to them."""

from __future__ import annotations

from typing import Any

from memfit.estimate.models.arch import ModelArch, UnsupportedArchitecture

# SiglipVisionConfig defaults (transformers/models/siglip/configuration_siglip.py), for the vision
# tower of multimodal Gemma-3 checkpoints whose vision_config omits num_channels.
_SIGLIP_DEFAULTS = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 16,
    "vision_use_head": False,
}


def unwrap_multimodal(cfg: dict[str, Any], model_type: str, where: str) -> tuple[dict[str, Any], str, int]:
    """(the language model's config, its model_type, vision tower parameters): a multimodal
    wrapper (Gemma-3 4b+) nests the LM in text_config; the rest is counted, not modelled."""
    vision_params = 0
    if isinstance(cfg.get("text_config"), dict):
        if model_type != "gemma3":
            raise UnsupportedArchitecture(
                f"{where}: 'text_config' (a multimodal wrapper) is supported for model_type "
                f"'gemma3' only, not {model_type or 'missing'!r}"
            )
        text = dict(cfg["text_config"])
        text.setdefault("model_type", "gemma3_text")
        if isinstance(cfg.get("vision_config"), dict):
            vision_params = gemma3_vision_params(cfg, text, where)
        cfg, model_type = text, str(text.get("model_type", model_type)).lower()
    if model_type == "gemma3":  # text-only gemma3 config without a text_config
        model_type = "gemma3_text"
    return cfg, model_type, vision_params


def from_chatglm(cfg: dict[str, Any], name: str, where: str, source: str) -> ModelArch:
    """Original THUDM ChatGLM/GLM-4 config.json (configuration_chatglm.ChatGLMConfig names)."""

    def get(key: str, *alts: str) -> Any:
        for k in (key, *alts):
            if cfg.get(k) is not None:
                return cfg[k]
        raise ValueError(f"{where}: config.json is missing {key!r} (the estimate needs it)")

    hidden = int(get("hidden_size"))
    heads = int(get("num_attention_heads"))
    # ChatGLMConfig: multi_query_group_num applies only when multi_query_attention is true;
    # kv_channels is the per-head width (128 in GLM-4-9B).
    mqa = bool(cfg.get("multi_query_attention", True))
    kv_heads = int(get("multi_query_group_num")) if mqa else heads
    if cfg.get("add_bias_linear"):
        raise ValueError(f"{where}: add_bias_linear=true ChatGLM variants are not supported")
    if not cfg.get("rmsnorm", True) or not cfg.get("post_layer_norm", True):
        raise ValueError(f"{where}: only rmsnorm=true, post_layer_norm=true ChatGLM is supported")
    return ModelArch(
        name=name,
        model_type="chatglm",
        hidden_size=hidden,
        intermediate_size=int(get("ffn_hidden_size")),
        num_layers=int(get("num_layers", "num_hidden_layers")),
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(get("kv_channels")),
        vocab_size=int(get("padded_vocab_size", "vocab_size")),
        max_position_embeddings=int(get("seq_length", "max_position_embeddings")),
        # ChatGLM's output_layer is a separate Linear unless tie_word_embeddings (false in GLM-4)
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("add_qkv_bias", False)),  # bias of query_key_value
        source=source,
    )


def gemma3_vision_params(cfg: dict[str, Any], text: dict[str, Any], where: str) -> int:
    """Parameters of the SigLIP vision tower + Gemma3MultiModalProjector (exact, per
    transformers' modeling_siglip.SiglipVisionModel and modeling_gemma3)."""
    vc = {**_SIGLIP_DEFAULTS, **(cfg.get("vision_config") or {})}
    vh, vi, vl = int(vc["hidden_size"]), int(vc["intermediate_size"]), int(vc["num_hidden_layers"])
    ch, img, patch = int(vc["num_channels"]), int(vc["image_size"]), int(vc["patch_size"])
    if vc.get("vision_use_head"):
        raise ValueError(f"{where}: SigLIP vision_use_head=true is not supported")
    # embeddings: Conv2d(ch, vh, patch, patch) with bias + one position embedding per patch
    embeddings = ch * patch * patch * vh + vh + (img // patch) ** 2 * vh
    # encoder layer: layer_norm1/2 (weight+bias), q/k/v/out_proj with bias, fc1/fc2 with bias
    layer = 2 * 2 * vh + 4 * (vh * vh + vh) + (vh * vi + vi) + (vi * vh + vh)
    post_layernorm = 2 * vh
    text_hidden = int(text.get("hidden_size", 0))
    if not text_hidden:
        raise ValueError(f"{where}: config.json is missing 'text_config.hidden_size'")
    # projector: mm_input_projection_weight (vh, text_hidden) + mm_soft_emb_norm RMSNorm(vh)
    projector = vh * text_hidden + vh
    return embeddings + vl * layer + post_layernorm + projector
