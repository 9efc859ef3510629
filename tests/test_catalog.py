"""The GPU and model catalogs: figures, parsing, and exact parameter counts.

Every catalog model is built with the real transformers class on the meta device (no memory,
no download) and compared module by module with ModelArch.num_params() / linear_shapes().
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from memfit import catalog

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

MODELS = catalog.load_models()
RAW_MODELS = yaml.safe_load(catalog.MODELS_YAML.read_text())

REQUIRED_MODELS = [
    "llama-2-7b", "llama-2-70b", "llama-3.1-8b", "llama-3.1-70b", "mistral-7b", "qwen2-7b",
    "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b", "qwen2-72b", "qwen3-8b",
    "qwen3-14b", "glm-4-9b", "gemma-3-4b", "gemma-3-12b", "gemma-3-27b",
]  # fmt: skip
REQUIRED_GPUS = [
    "a100-40gb", "a100-80gb", "h100-80gb", "h200", "rtx3090", "rtx4090", "v100-16gb",
    "v100-32gb", "l40s", "a10", "t4", "a6000", "cpu",
]  # fmt: skip

# Exact parameter counts of the HF implementations (text tower for Gemma-3). Public
# cross-checks: Llama-2-7B 6,738,415,616 (the widely quoted exact figure); Llama-3.1-8B
# "8.03B"; Mistral-7B "7.24B"; Qwen2.5-7B "7.61B"; Qwen2.5-14B "14.7B"; Qwen2.5-32B "32.5B
# non-embedding / 32.8B"; Qwen2.5-72B "72.7B"; Qwen3-8B "8.2B"; Qwen3-14B "14.8B";
# GLM-4-9B "9.4B"; Gemma-3 4b/12b/27b "4.3B/12.2B/27.4B" including the vision tower.
KNOWN_PARAMS = {
    "llama-2-7b": 6_738_415_616,
    "llama-2-70b": 68_976_648_192,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096,
    "mistral-7b-v0.3": 7_248_023_552,
    "qwen2-7b": 7_615_616_512,
    "qwen2-72b": 72_706_203_648,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-14b": 14_770_033_664,
    "qwen2.5-32b": 32_763_876_352,
    "qwen2.5-72b": 72_706_203_648,
    "qwen3-8b": 8_190_735_360,
    "qwen3-14b": 14_768_307_200,
    "glm-4-9b": 9_399_951_360,
    "gemma-3-4b": 3_880_263_168,
    "gemma-3-12b": 11_766_034_176,
    "gemma-3-27b": 27_009_346_304,
}
KNOWN_VISION_PARAMS = {  # SigLIP tower + projector of the multimodal Gemma-3 checkpoints
    "gemma-3-4b": 419_816_304,  # total 4,300,079,472
    "gemma-3-12b": 421_290_864,  # total 12,187,325,040
    "gemma-3-27b": 423_060_336,  # total 27,432,406,640
}

# THUDM/glm-4-9b-chat config.json (model_type chatglm), architecture fields as published.
GLM4_9B_CHAT_ORIGINAL = {
    "architectures": ["ChatGLMModel"],
    "model_type": "chatglm",
    "add_bias_linear": False,
    "add_qkv_bias": True,
    "apply_residual_connection_post_layernorm": False,
    "ffn_hidden_size": 13696,
    "hidden_size": 4096,
    "kv_channels": 128,
    "layernorm_epsilon": 1.5625e-07,
    "multi_query_attention": True,
    "multi_query_group_num": 2,
    "num_attention_heads": 32,
    "num_hidden_layers": 40,
    "num_layers": 40,
    "original_rope": True,
    "padded_vocab_size": 151552,
    "post_layer_norm": True,
    "rmsnorm": True,
    "rope_ratio": 500,
    "seq_length": 131072,
    "tie_word_embeddings": False,
    "vocab_size": 151552,
}


def _meta_model(cfg):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # shared (tied) tensors counted once


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.model.layers


def test_required_models_present():
    assert set(REQUIRED_MODELS) <= set(MODELS)
    assert all(name == name.lower() for name in MODELS)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_num_params_and_linear_shapes_match_transformers(name):
    arch = MODELS[name]
    model = _meta_model(arch.to_hf_config())
    assert arch.num_params() == _count(model)
    assert arch.num_params() == KNOWN_PARAMS[name]
    assert arch.vision_params == KNOWN_VISION_PARAMS.get(name, 0)

    for layer in _decoder_layers(model):
        linears = {
            n.rsplit(".", 1)[-1]: (m.in_features, m.out_features)
            for n, m in layer.named_modules()
            if isinstance(m, torch.nn.Linear)
        }
        # every linear layer in the decoder layer is listed, with its exact shape
        assert linears == arch.linear_shapes()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_published_config_read_by_transformers_gives_same_count(name):
    """transformers' own reading of the catalog's config.json fields (its class defaults filling
    the gaps) builds a model of exactly num_params (+ vision_params for multimodal Gemma-3)."""
    raw = dict(RAW_MODELS[name]["config"])
    model_type = raw.pop("model_type")
    raw.pop("architectures", None)
    cfg = AutoConfig.for_model(model_type, **raw)
    arch = MODELS[name]
    if model_type == "gemma3":
        from transformers import Gemma3ForConditionalGeneration

        with torch.device("meta"):
            full = Gemma3ForConditionalGeneration(cfg)
        assert _count(full) == arch.num_params() + arch.vision_params
        text = full.model.language_model
        assert _count(text) == arch.num_params()  # lm_head is tied to embed_tokens
        assert len(text.layers) == arch.num_layers
    else:
        assert _count(_meta_model(cfg)) == arch.num_params()


def test_gemma3_defaults_match_transformers():
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig()
    for key, value in catalog._HF_DEFAULTS["gemma3_text"].items():
        if key == "sliding_window_pattern":
            # transformers 5 keeps the pattern as layer_types: every 6th layer is global
            types = cfg.layer_types
            assert [i for i, t in enumerate(types) if t == "full_attention"][0] == value - 1
            continue
        assert getattr(cfg, key) == value, key


def test_model_fields_for_stories():
    qwen = catalog.model("qwen2-7b")
    assert (qwen.hidden_size, qwen.num_layers, qwen.num_kv_heads, qwen.vocab_size) == (
        3584, 28, 4, 152064,
    )  # fmt: skip
    assert qwen.attention_bias and not qwen.attention_out_bias and qwen.sliding_window is None
    assert catalog.model("mistral-7b").sliding_window == 4096
    assert catalog.model("mistral-7b-v0.3").sliding_window is None
    gemma = catalog.model("gemma-3-27b")
    assert (gemma.head_dim, gemma.num_attention_heads, gemma.num_kv_heads) == (128, 32, 16)
    assert gemma.sliding_window == 1024 and gemma.sliding_window_pattern == 6
    assert gemma.tie_word_embeddings and gemma.qk_norm and gemma.norms_per_layer == 4
    glm = catalog.model("glm-4-9b")
    assert glm.fused_gate_up and glm.linear_shapes()["gate_up_proj"] == (4096, 2 * 13696)
    assert catalog.model("qwen3-8b").head_dim == 128


def test_aliases_and_hub_ids_resolve_to_catalog():
    assert catalog.model("Qwen2.5-7B-Instruct").name == "qwen2.5-7b"
    assert catalog.model("Qwen/Qwen2.5-72B-Instruct").name == "qwen2.5-72b"
    assert catalog.model(" LLAMA-2-7B ").name == "llama-2-7b"
    assert catalog.gpu("H100").name == "h100-80gb"
    assert catalog.gpu("A100").name == "a100-40gb"


# ----------------------------------------------------------------------------- config files


def _write(tmp_path: Path, cfg: dict, sub: str = "model") -> Path:
    d = tmp_path / sub
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_chatglm_original_config_parses_like_glm_hf(tmp_path):
    d = _write(tmp_path, GLM4_9B_CHAT_ORIGINAL)
    for arg in (d, d / "config.json", str(d)):
        arch = catalog.model(arg)
        assert arch.model_type == "chatglm"
        assert (arch.num_kv_heads, arch.head_dim, arch.intermediate_size) == (2, 128, 13696)
        assert (arch.vocab_size, arch.max_position_embeddings) == (151552, 131072)
        assert arch.num_params() == catalog.model("glm-4-9b").num_params() == 9_399_951_360
    # Same weights, THUDM module names: query_key_value is q|k|v, dense_h_to_4h is gate|up.
    shapes = arch.linear_shapes()
    assert shapes == {
        "query_key_value": (4096, 4096 + 2 * 256),
        "dense": (4096, 4096),
        "dense_h_to_4h": (4096, 2 * 13696),
        "dense_4h_to_h": (13696, 4096),
    }
    glm_shapes = catalog.model("glm-4-9b").linear_shapes()
    assert sum(i * o for i, o in shapes.values()) == sum(i * o for i, o in glm_shapes.values())
    # and the HF config it maps to builds the transformers GLM with that count
    assert arch.hf_model_type == "glm"
    assert _count(_meta_model(arch.to_hf_config())) == arch.num_params()


def test_hf_config_file_matches_catalog_card(tmp_path):
    for name in ("qwen3-8b", "gemma-3-4b", "llama-3.1-8b"):
        d = _write(tmp_path, RAW_MODELS[name]["config"], sub=name)
        from_file = catalog.model(d)
        card = MODELS[name]
        assert from_file.name == str(d / "config.json")
        assert from_file.num_params() == card.num_params()
        assert from_file.vision_params == card.vision_params
        assert from_file.linear_shapes() == card.linear_shapes()


def test_generic_llama_like_config(tmp_path):
    cfg = {
        "model_type": "my_llama",  # unknown to memfit: read with the standard field names
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 1000,
        "max_position_embeddings": 512,
    }
    arch = catalog.model(_write(tmp_path, cfg))
    assert arch.num_kv_heads == 4 and arch.head_dim == 64  # HF defaults: MHA, hidden/heads
    assert not arch.tie_word_embeddings  # untied unless told: counts the lm_head
    assert arch.hf_model_type == "llama"
    assert _count(_meta_model(arch.to_hf_config())) == arch.num_params()


@pytest.mark.parametrize(
    "cfg, missing",
    [
        ({"model_type": "llama", "intermediate_size": 11008, "num_hidden_layers": 32,
          "num_attention_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096},
         "hidden_size"),
        ({"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
          "num_hidden_layers": 28, "num_attention_heads": 28, "max_position_embeddings": 32768},
         "vocab_size"),
        ({"model_type": "gemma3", "text_config": {"hidden_size": 2560,
          "num_hidden_layers": 34}}, "intermediate_size"),
        ({k: v for k, v in GLM4_9B_CHAT_ORIGINAL.items() if k != "ffn_hidden_size"},
         "ffn_hidden_size"),
    ],
)  # fmt: skip
def test_missing_field_names_file_and_field(tmp_path, cfg, missing):
    d = _write(tmp_path, cfg)
    with pytest.raises(ValueError) as err:
        catalog.model(d / "config.json")
    assert str(d / "config.json") in str(err.value)
    assert repr(missing) in str(err.value)


def test_bad_paths(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        catalog.model(tmp_path / "empty")
    with pytest.raises(ValueError, match="never downloads"):
        catalog.model("meta-llama/Not-A-Model")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        catalog.model(tmp_path / "bad.json")


def test_unknown_model_name_lists_allowed_and_suggests():
    with pytest.raises(ValueError) as err:
        catalog.model("qwen2.5-8b")
    msg = str(err.value)
    assert "unknown model 'qwen2.5-8b'" in msg
    assert "Did you mean 'qwen2.5-7b'?" in msg
    assert all(name in msg for name in REQUIRED_MODELS)


# ----------------------------------------------------------------------------- GPUs

GPUS = catalog.load_gpus()


def test_required_gpus_present_with_every_field():
    assert set(REQUIRED_GPUS) <= set(GPUS)
    for g in GPUS.values():
        assert g.memory_bytes > 0 and g.memory_bytes % 2**20 == 0
        assert g.tflops_fp32 > 0 and g.memory_bandwidth_gbs > 0 and g.host_link_gbs > 0
        assert g.interconnect_gbs > 0 and g.typical_gpus_per_node >= 1
        assert g.typical_host_memory_gb > 0 and g.source
        if g.name != "cpu":
            assert "https://" in g.source
            assert g.tflops_fp16 >= g.tflops_bf16 > 0 or not g.bf16
            assert g.tflops_fp16 < 1000  # dense figures, not the sparse ones (H100: 989.5)


def test_nvidia_smi_memory_figures():
    mib = {name: g.memory_bytes // 2**20 for name, g in GPUS.items()}
    assert mib["a100-40gb"] == 40960
    assert mib["a100-80gb"] == 81920
    assert mib["h100-80gb"] == 81559
    assert mib["h200"] == 143771
    assert mib["rtx3090"] == 24576
    assert mib["rtx4090"] == 24564
    assert mib["v100-16gb"] == 16384
    assert mib["v100-32gb"] == 32768
    assert mib["l40s"] == 46068
    assert mib["a10"] == 23028
    assert mib["t4"] == 15360
    assert mib["a6000"] == 49140
    assert GPUS["a100-80gb"].memory_gib == 80.0


def test_bf16_and_flash_attention_support():
    for name in ("v100-16gb", "v100-32gb", "t4"):
        g = GPUS[name]
        assert not g.bf16 and not g.flash_attn2 and g.tflops_bf16 == 0
        assert g.tflops("fp16") > 0
    for name, g in GPUS.items():
        if name == "cpu":
            assert g.bf16 and not g.flash_attn2
            continue
        # FlashAttention-2: Ampere, Ada, Hopper (sm80+) only; bf16 likewise
        sm80_plus = float(g.compute_capability) >= 8.0
        assert g.flash_attn2 == sm80_plus == g.bf16, name
    with pytest.raises(ValueError, match="unknown precision"):
        GPUS["a100-80gb"].tflops("fp8")


def test_host_memory_defaults():
    assert (GPUS["a100-80gb"].typical_gpus_per_node, GPUS["a100-80gb"].typical_host_memory_gb) == (
        8, 1024,
    )  # fmt: skip
    assert GPUS["rtx4090"].typical_gpus_per_node == 4
    assert GPUS["rtx4090"].typical_host_memory_gb == 256


def test_unknown_gpu_name_lists_allowed_and_suggests():
    with pytest.raises(ValueError) as err:
        catalog.gpu("a100-80")
    msg = str(err.value)
    assert "unknown GPU 'a100-80'" in msg and "Did you mean 'a100-80gb'?" in msg
    assert all(name in msg for name in REQUIRED_GPUS)


def test_gpu_yaml_missing_field_is_an_error(tmp_path):
    bad = tmp_path / "gpus.yaml"
    bad.write_text(yaml.safe_dump({"x1": {"memory_mib": 1024, "bf16": True}}))
    with pytest.raises(ValueError, match="missing"):
        catalog.load_gpus(bad)


def test_text_only_gemma3_config(tmp_path):
    # google/gemma-3-1b-it style: model_type gemma3_text at the top level, no vision tower
    cfg = {
        "model_type": "gemma3_text",
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "vocab_size": 262144,
        "max_position_embeddings": 32768,
        "sliding_window": 512,
    }
    arch = catalog.model(_write(tmp_path, cfg))
    assert arch.vision_params == 0 and arch.tie_word_embeddings
    assert arch.num_params() == _count(_meta_model(arch.to_hf_config())) == 999_885_952
