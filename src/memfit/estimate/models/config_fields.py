"""config.json values the estimate refuses before reading any card, each naming the key and the
value: sizes that are not positive whole numbers (transformers >= 5 refuses a float, a bool or a
string for an int field: `StrictDataclassFieldValidationError ... expected int`; a zero or
negative size builds an empty or impossible model), heads that key/value heads do not split, and
encoder-only models (BERT and its kin), which transformers builds as a causal LM only when the
config says `is_decoder: true`. memfit trains causal LMs."""

from __future__ import annotations

from typing import Any

from memfit.estimate.models.arch import UnsupportedArchitecture

# Sizes every formula and transformers' layers read: a positive integer where present (null is
# "absent": transformers' class default). The second group names them as ChatGLMConfig does.
POSITIVE_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "ffn_hidden_size",
    "num_layers",
    "kv_channels",
    "padded_vocab_size",
    "seq_length",
    "multi_query_group_num",
)
# Fields that add or reshape weights in some architecture. A config.json that sets one on a
# model_type that does not model it (memfit.estimate.models.hf_config's `_MODELLED_FIELDS`) describes
# weights memfit cannot count: refused.
MOE_FIELDS = (
    "num_local_experts",
    "num_experts",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "first_k_dense_replace",
    "moe_layer_freq",
    "decoder_sparse_step",
    "mlp_only_layers",
)
# Of those, the counts: whole numbers, 0 allowed (a dense layer; `hf_config._refuse_unmodelled`).
COUNTS = tuple(f for f in MOE_FIELDS if f not in ("moe_layer_freq", "mlp_only_layers"))


def check_values(cfg: dict[str, Any], where: str) -> None:
    """ValueError naming the first key whose value cannot be a size (in `cfg` or its text_config);
    UnsupportedArchitecture for an encoder (`check_decoder`)."""
    check_decoder(cfg, str(cfg.get("model_type", "") or "").lower(), where)
    for section, prefix in ((cfg, ""), (cfg.get("text_config"), "text_config.")):
        if not isinstance(section, dict):
            continue
        for key in (*POSITIVE_SIZES, *COUNTS):
            value = section.get(key)
            if value is None:
                continue
            least = 1 if key in POSITIVE_SIZES else 0
            if isinstance(value, bool) or not isinstance(value, int):
                kind = type(value).__name__ if not isinstance(value, str) else "a string"
                raise ValueError(
                    f"{where}: {prefix}{key} = {value!r} is not a whole number ({kind}); transformers "
                    f"reads it as an int (expected int, got {type(value).__name__})"
                )
            if value < least:
                need = "positive" if least else "0 or more"
                raise ValueError(f"{where}: {prefix}{key} = {value} must be {need}")


def check_heads(get: Any, where: str) -> None:
    """A hand-described card's attention heads: key/value heads split the query heads evenly
    (transformers' repeat_kv, modeling_llama, repeats each key/value head heads // kv times), and
    without head_dim the hidden size splits into the heads (PreTrainedConfig.validate_architecture:
    "The hidden size ... is not a multiple of the number of attention heads")."""
    heads = get("num_attention_heads")
    kv = get("num_key_value_heads", default=heads)
    if heads % kv:
        raise ValueError(
            f"{where}: num_attention_heads = {heads} is not a multiple of num_key_value_heads = {kv}: "
            "each key/value head serves a whole group of query heads"
        )
    if get("head_dim", default=None) is None and get("hidden_size") % heads:
        raise ValueError(
            f"{where}: hidden_size = {get('hidden_size')} is not a multiple of num_attention_heads = "
            f"{heads} (and config.json sets no head_dim)"
        )


def _encoder_types() -> dict[str, str]:
    """Types transformers has a masked-LM head for and builds as a causal LM too (BertLMHeadModel,
    RobertaForCausalLM, BartForCausalLM ...): encoders, or encoder-decoders, first. {type: class}."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    return {t: c for t, c in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if t in MODEL_FOR_MASKED_LM_MAPPING_NAMES}


def check_decoder(cfg: dict[str, Any], model_type: str, where: str) -> None:
    """Refuse an encoder-only (or encoder-decoder) config: its causal-LM class (BertLMHeadModel)
    warns "add is_decoder=True" and would train a bidirectional encoder on a causal loss."""
    cls = _encoder_types().get(model_type)
    if cls is None:
        return
    if model_type == "xlm":  # XLMWithLMHeadModel: causal attention only with `causal: true`
        if cfg.get("causal"):
            return
        raise UnsupportedArchitecture(
            f"{where}: model_type 'xlm' without causal: true is an encoder (masked LM); memfit trains causal LMs"
        )
    if cfg.get("is_decoder") is True:  # the *ForCausalLM class builds the decoder (BartForCausalLM: of a seq2seq)
        return
    what = "an encoder-decoder" if cfg.get("is_encoder_decoder") else "an encoder-only model"
    raise UnsupportedArchitecture(
        f"{where}: model_type {model_type!r} is {what} (masked LM; is_decoder is not true), and "
        f"transformers' {cls} predicts the next token only as a decoder: memfit trains causal LMs "
        "(set is_decoder: true only if this checkpoint really is a decoder)"
    )
