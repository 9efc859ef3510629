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

from memfit.estimate.models import catalog, hf_config, inventory

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

# The hand-written cards; the entries without one (flagship models read from transformers) are
# checked in tests/test_flagship.py and tests/test_inventory.py.
MODELS = {n: a for n, a in catalog.load_models().items() if not a.generic}
FIXTURES = Path(__file__).parent / "fixtures" / "hf_configs"
RAW_MODELS = yaml.safe_load(catalog.MODELS_YAML.read_text())

REQUIRED_MODELS = [
    "llama-2-7b", "llama-2-70b", "llama-3.1-8b", "llama-3.1-70b", "mistral-7b", "qwen2-7b",
    "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b", "qwen2-72b", "qwen3-8b",
    "qwen3-14b", "glm-4-9b", "gemma-3-4b", "gemma-3-12b", "gemma-3-27b",
    # issue 12
    "llama-3.2-1b", "llama-3.2-3b", "llama-3.3-70b", "qwen3-32b", "qwen3-30b-a3b",
    "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "mistral-nemo-12b", "mixtral-8x7b",
    "phi-3.5-mini", "phi-4",
]  # fmt: skip
REQUIRED_GPUS = [
    "a100-40gb", "a100-80gb", "h100-80gb", "h200", "rtx3090", "rtx4090", "v100-16gb",
    "v100-32gb", "l40s", "a10", "t4", "a6000", "cpu",
    # issue 12
    "h100-pcie", "b200", "a100-80gb-pcie", "l4", "a10g", "mi300x",
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
    # issue 12. Model cards: Llama-3.2 "1.23B"/"3.21B"; Qwen2.5 "0.49B"/"1.54B"/"3.09B";
    # Qwen3-32B "32.8B"; Mistral-Nemo "12B"; Phi-3.5-mini "3.8B"; Phi-4 "14B"; Mixtral-8x7B
    # "46.7B total"; Qwen3-30B-A3B "30.5B in total".
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.3-70b": 70_553_706_496,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-3b": 3_085_938_688,
    "qwen3-32b": 32_762_123_264,
    "mistral-nemo-12b": 12_247_782_400,
    "phi-3.5-mini": 3_821_079_552,
    "phi-4": 14_659_507_200,
    "mixtral-8x7b": 46_702_792_704,
    "qwen3-30b-a3b": 30_532_122_624,
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


def _check_layers(arch: catalog.ModelArch, model: torch.nn.Module) -> None:
    """Every decoder layer's nn.Linear modules, expert tensors and router match the card."""
    moe_layers = set(arch.moe_layers())
    layers = _decoder_layers(model)
    assert len(layers) == arch.num_layers
    for i, layer in enumerate(layers):
        linears = {
            n.rsplit(".", 1)[-1]: (m.in_features, m.out_features)
            for n, m in layer.named_modules()
            if isinstance(m, torch.nn.Linear)
        }
        # every linear layer in the decoder layer is listed, with its exact shape
        if i in moe_layers:
            assert linears == arch.linear_shapes(), i
            experts, router = layer.mlp.experts, layer.mlp.gate
            e_shapes = arch.expert_linear_shapes()
            # transformers stores experts as (E, out, in) 3D parameters
            for pname, (fan_in, fan_out) in e_shapes.items():
                assert tuple(getattr(experts, pname).shape) == (arch.num_experts, fan_out, fan_in)
            assert _count(experts) == arch.num_experts * arch.expert_params()
            fan_in, fan_out = arch.router_shape()
            assert tuple(router.weight.shape) == (fan_out, fan_in)
        else:
            assert linears == arch.dense_layer_linear_shapes(), i
        assert _count(layer) == arch.layer_params(i), i


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
    _check_layers(arch, model)
    if not arch.is_moe:
        assert arch.num_active_params() == arch.num_params()
        assert arch.linear_shapes() == arch.dense_layer_linear_shapes()
        assert arch.expert_linear_shapes() == {} and arch.moe_layers() == ()


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
    for key, value in hf_config._HF_DEFAULTS["gemma3_text"].items():
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


@pytest.mark.parametrize(
    "hub_id, name",
    [
        ("Qwen/Qwen2.5-7B", "qwen2.5-7b"),  # base id; the card copies -Instruct
        ("qwen/qwen2.5-7b-instruct", "qwen2.5-7b"),  # case-insensitive
        ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),  # -Instruct maps to the base card
        ("meta-llama/Llama-3.1-8B", "llama-3.1-8b"),
        ("meta-llama/Llama-2-7b-chat-hf", "llama-2-7b"),  # -chat-hf
        ("meta-llama/Llama-3.2-1B-Instruct", "llama-3.2-1b"),
        ("Qwen/Qwen2.5-0.5B", "qwen2.5-0.5b"),
        ("mistralai/Mistral-Nemo-Instruct-2407", "mistral-nemo-12b"),
        ("google/gemma-3-4b-pt", "gemma-3-4b"),
        ("microsoft/phi-4", "phi-4"),
    ],
)
def test_hub_ids_resolve_to_catalog_cards(hub_id, name):
    assert catalog.model(hub_id).name == name
    assert catalog.hub_id_card(hub_id).name == name


def test_hub_id_of_moe_model_and_unknown_ids():
    assert catalog.model("mistralai/Mixtral-8x7B-v0.1", allow_moe=True).name == "mixtral-8x7b"
    assert catalog.model("Qwen/Qwen3-30B-A3B", allow_moe=True).name == "qwen3-30b-a3b"
    # another organisation's repository of the same name is not taken for the original
    assert catalog.hub_id_card("someone/Llama-3.1-8B-Instruct") is None
    with pytest.raises(ValueError, match="never downloads"):
        catalog.model("someone/Llama-3.1-8B-Instruct")


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


LLAMA_SMALL = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 1000,
    "max_position_embeddings": 512,
}


def test_llama_config_with_hf_defaults(tmp_path):
    arch = catalog.model(_write(tmp_path, LLAMA_SMALL))
    assert arch.num_kv_heads == 4 and arch.head_dim == 64  # HF defaults: MHA, hidden/heads
    assert not arch.tie_word_embeddings  # LlamaConfig default: untied
    assert arch.hf_model_type == "llama"
    assert _count(_meta_model(arch.to_hf_config())) == arch.num_params()


# Configs without a hand-written card (another model_type, or a field a card does not model):
# estimated from the model transformers builds, so the count is what transformers holds
# (issue 21: "a refusal only where transformers itself cannot build the model").
GENERIC = [
    {**LLAMA_SMALL, "model_type": "falcon"},
    {**LLAMA_SMALL, "model_type": "olmo3"},
    {**LLAMA_SMALL, "model_type": "gpt_oss", "num_local_experts": 4, "num_experts_per_tok": 2},
    {**LLAMA_SMALL, "num_local_experts": 8},  # a field LlamaConfig keeps but its model ignores
    {**LLAMA_SMALL, "model_type": "deepseek_v3", "moe_layer_freq": 2, "n_routed_experts": 4,
     "num_experts_per_tok": 2, "moe_intermediate_size": 64, "first_k_dense_replace": 1,
     "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
     "v_head_dim": 16, "n_group": 1, "topk_group": 1},
    {**LLAMA_SMALL, "n_embd": 256},
]  # fmt: skip


@pytest.mark.parametrize("cfg", GENERIC, ids=lambda c: c["model_type"])
def test_configs_without_a_card_are_counted_on_transformers_model(tmp_path, cfg):
    arch = catalog.model(_write(tmp_path, cfg), allow_moe=True)
    assert arch.generic
    real = _meta_model(inventory.config_from_dict(cfg))
    assert arch.num_params() == _count(real)
    experts = sum(p.numel() for n, p in real.named_parameters() if ".experts." in n)
    if experts:
        per_tok = cfg["num_experts_per_tok"] / (cfg.get("num_local_experts") or cfg["n_routed_experts"])
        assert arch.num_active_params() == _count(real) - experts + int(experts * per_tok)
    else:
        assert arch.num_active_params() == arch.num_params()


def test_multimodal_wrapper_is_estimated_on_its_text_model(tmp_path):
    """A llava checkpoint: the text model's card, the vision tower and projector counted beside."""
    cfg = {"model_type": "llava", "text_config": dict(LLAMA_SMALL)}
    arch = catalog.model(_write(tmp_path, cfg))
    text = _meta_model(inventory.config_from_dict(LLAMA_SMALL))
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        whole = AutoModelForImageTextToText.from_config(inventory.config_from_dict(cfg))
    assert arch.model_type == "llama" and arch.num_params() == _count(text)
    assert arch.vision_params == _count(whole) - _count(text) > 0


REFUSED = [
    ({**LLAMA_SMALL, "model_type": "my_llama"}, "'my_llama'"),
    ({k: v for k, v in LLAMA_SMALL.items() if k != "model_type"}, "'model_type'"),
    ({**LLAMA_SMALL, "model_type": "t5"}, "'t5'"),  # an encoder-decoder: no causal LM of it
]


@pytest.mark.parametrize("cfg, field", REFUSED)
def test_what_transformers_cannot_build_is_refused_naming_it(tmp_path, cfg, field):
    d = _write(tmp_path, cfg)
    with pytest.raises(catalog.UnsupportedArchitecture) as err:
        catalog.model(d)
    assert isinstance(err.value, ValueError)  # the CLIs report ValueErrors as exit 2
    assert field in str(err.value) and str(d / "config.json") in str(err.value)


def test_gpt2_config_is_estimated_from_transformers(capsys):
    """GPT-2 (learned positions, LayerNorm with bias, Conv1D, non-gated MLP): no card, so its
    parameters come from transformers' GPT2LMHeadModel (124,439,808 for the published config,
    huggingface.co/openai-community/gpt2) and LoRA targets its Conv1D c_attn/c_proj/c_fc."""
    from memfit.estimate import main

    arch = catalog.model(FIXTURES / "gpt2.json")
    assert arch.generic and arch.num_params() == 124_439_808 and arch.tie_word_embeddings
    argv = [
        "--model",
        str(FIXTURES / "gpt2.json"),
        "--gpu",
        "h100-80gb",
        "--num-gpus",
        "8",
        "--finetune",
        "lora",
        "--seq-len",
        "1024",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "activations traced" in out and "0.124 B total" in out


def test_unbuildable_config_is_exit_2_from_the_cli(capsys, tmp_path):
    from memfit.estimate import main

    d = _write(tmp_path, {**LLAMA_SMALL, "model_type": "my_llama"})
    assert main(["--model", str(d), "--gpu", "h100-80gb", "--num-gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert "'my_llama'" in err and "Traceback" not in err


def test_non_utf8_config_names_the_file(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_bytes(b'{"model_type": "llama", "name": "' + bytes([0xFF, 0xFE]) + b'"}')
    with pytest.raises(ValueError, match="not UTF-8") as err:
        catalog.model(bad)
    assert str(bad) in str(err.value)


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
            # dense figures, not the sparse ones the datasheets print with a "*"
            dense = {"b200": 2250, "mi300x": 1307.4, "h100-80gb": 989.5, "h200": 989.5}
            assert g.tflops_fp16 <= dense.get(g.name, 989.5)


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
    assert mib["h100-pcie"] == 81559
    assert mib["b200"] == 183359
    assert mib["a100-80gb-pcie"] == 81920
    assert mib["l4"] == 23034
    assert mib["a10g"] == 23028
    assert mib["mi300x"] == 196592
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
        # FlashAttention-2: Ampere, Ada, Hopper, Blackwell B200 (sm80+; not Turing or Volta);
        # MI300X through FA2's ROCm backend (planning only). bf16 likewise.
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


def test_h100_sxm_and_pcie_are_different_cards():
    sxm, pcie = GPUS["h100-80gb"], GPUS["h100-pcie"]
    assert catalog.gpu("h100-sxm") is sxm and catalog.gpu("h100-pcie-80gb") is pcie
    assert sxm.memory_bytes == pcie.memory_bytes
    assert (sxm.memory_bandwidth_gbs, pcie.memory_bandwidth_gbs) == (3350, 2000)
    assert pcie.tflops_bf16 < sxm.tflops_bf16 and pcie.interconnect_kind == "pcie"
    assert GPUS["h200"].memory_bandwidth_gbs == 4800  # its own HBM3e figure, not the H100's
    assert GPUS["a100-80gb-pcie"].memory_bandwidth_gbs == 1935 < GPUS["a100-80gb"].memory_bandwidth_gbs


def test_planning_only_gpus_say_why(tmp_path):
    planning = {name for name, g in GPUS.items() if g.planning_only}
    assert planning == {"mi300x"}
    assert "ROCm" in GPUS["mi300x"].planning_reason
    bad = tmp_path / "gpus.yaml"
    entry = {f: getattr(GPUS["mi300x"], f) for f in ("bf16", "flash_attn2", "compute_capability",
             "tflops_bf16", "tflops_fp16", "tflops_fp32", "memory_bandwidth_gbs", "host_link_gbs",
             "interconnect_gbs", "typical_gpus_per_node", "typical_host_memory_gb", "source")}  # fmt: skip
    bad.write_text(yaml.safe_dump({"x1": {**entry, "memory_mib": 1024, "planning_only": True}}))
    with pytest.raises(ValueError, match="planning_reason"):
        catalog.load_gpus(bad)


# ----------------------------------------------------------------------------- mixture of experts

# Fixture config.json files (tests/fixtures/hf_configs/README.md names each source) and the
# published counts: (total, active per token, the active figure's last printed digit, what
# "active" counts). Totals must be within 1%; active figures within one unit of their last
# printed digit (cards round or truncate: Qwen3-30B-A3B counts 3.35B and prints "3.3B").
MOE_PUBLISHED = {
    # "Mixtral has 46.7B total parameters but only uses 12.9B parameters per token"
    # (https://mistral.ai/news/mixtral-of-experts/; model card of mistralai/Mixtral-8x7B-v0.1)
    "mixtral-8x7b-v0.1.json": (46.7e9, 12.9e9, 0.1e9, "all"),
    # "14.3B parameters in total and 2.7B activated parameters during runtime"
    # (https://huggingface.co/Qwen/Qwen1.5-MoE-A2.7B)
    "qwen1.5-moe-a2.7b.json": (14.3e9, 2.7e9, 0.1e9, "all"),
    # "57B parameters in total, 14B activated" (https://huggingface.co/Qwen/Qwen2-57B-A14B)
    "qwen2-57b-a14b.json": (57e9, 14e9, 1e9, "all"),
    # "Number of Parameters: 30.5B in total and 3.3B activated"
    # (https://huggingface.co/Qwen/Qwen3-30B-A3B)
    "qwen3-30b-a3b.json": (30.5e9, 3.3e9, 0.1e9, "all"),
    # "Total parameters: 671B; Activation parameters: 36.6B (including 0.9B for the output Head)"
    # -- the 0.9B input embedding is not counted as active (README_WEIGHTS.md of
    # https://huggingface.co/deepseek-ai/DeepSeek-V3); the MTP module (num_nextn_predict_layers)
    # is outside these 671B and outside transformers' DeepseekV3ForCausalLM.
    "deepseek-v3.json": (671e9, 36.6e9, 0.1e9, "no_embedding"),
}


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def _transformers_reading(raw: dict):
    raw = {k: v for k, v in raw.items() if k not in ("auto_map", "quantization_config")}
    model_type = raw.pop("model_type")
    raw.pop("architectures", None)
    return AutoConfig.for_model(model_type, **raw)


@pytest.mark.parametrize("fixture", sorted(MOE_PUBLISHED))
def test_moe_counts_match_published_figures_and_transformers(fixture):
    arch = catalog.model(FIXTURES / fixture, allow_moe=True)
    total, active, last_digit, convention = MOE_PUBLISHED[fixture]
    assert arch.is_moe and arch.num_experts > arch.num_experts_per_tok > 0
    assert abs(arch.num_params() - total) <= 0.01 * total
    counted_active = arch.num_active_params()
    if convention == "no_embedding":
        counted_active -= arch.vocab_size * arch.hidden_size
    assert abs(counted_active - active) <= last_digit
    # exactly what transformers builds from the same config.json, every expert included
    assert _count(_meta_model(_transformers_reading(_fixture(fixture)))) == arch.num_params()


def _reduced(raw: dict) -> dict:
    """The same architecture at toy sizes, with dense layers between MoE layers where the
    model_type allows them, so every code path is exercised at a size the test can afford."""
    small = dict(raw)
    small.update(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
        vocab_size=256, intermediate_size=96, max_position_embeddings=512,
    )  # fmt: skip
    mt = raw["model_type"]
    if mt == "mixtral":
        small.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)
    if mt in ("qwen2_moe", "qwen3_moe"):
        small.update(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                     decoder_sparse_step=2, mlp_only_layers=[3])  # fmt: skip
        small["head_dim"] = 16
        if mt == "qwen2_moe":
            small["shared_expert_intermediate_size"] = 80
    if mt == "deepseek_v3":
        small.update(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                     n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=24,
                     kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                     num_key_value_heads=4, n_group=1, topk_group=1)  # fmt: skip
    return small


@pytest.mark.parametrize("fixture", sorted(MOE_PUBLISHED))
def test_reduced_moe_configs_match_transformers_module_by_module(fixture, tmp_path):
    raw = _reduced(_fixture(fixture))
    arch = catalog.model(_write(tmp_path, raw), allow_moe=True)
    model = _meta_model(_transformers_reading(raw))
    assert _count(model) == arch.num_params()
    _check_layers(arch, model)
    # and the config memfit writes back builds the same modules
    assert _count(_meta_model(arch.to_hf_config())) == arch.num_params()
    if raw["model_type"] in ("qwen2_moe", "qwen3_moe"):
        assert arch.dense_layers == (0, 2, 3)  # step 2 skips layers 0 and 2; 3 is mlp-only
    if raw["model_type"] == "deepseek_v3":
        assert arch.dense_layers == (0,) and arch.uses_mla


def test_more_experts_per_token_than_experts_is_an_error(tmp_path):
    raw = {**_fixture("mixtral-8x7b-v0.1.json"), "num_experts_per_tok": 9}
    with pytest.raises(ValueError, match="'num_experts_per_tok' = 9"):
        catalog.model(_write(tmp_path, raw), allow_moe=True)


def test_deepseek_v3_without_query_compression(tmp_path):
    raw = {**_reduced(_fixture("deepseek-v3.json")), "q_lora_rank": None}
    arch = catalog.model(_write(tmp_path, raw), allow_moe=True)
    assert "q_proj" in arch.linear_shapes() and "q_a_proj" not in arch.linear_shapes()
    model = _meta_model(_transformers_reading(raw))
    assert _count(model) == arch.num_params()
    _check_layers(arch, model)


def test_moe_structure_of_the_published_models():
    mixtral = catalog.model(FIXTURES / "mixtral-8x7b-v0.1.json", allow_moe=True)
    assert (mixtral.num_experts, mixtral.num_experts_per_tok) == (8, 2)
    assert mixtral.expert_linear_shapes() == {
        "gate_up_proj": (4096, 2 * 14336),
        "down_proj": (14336, 4096),
    }
    assert set(mixtral.linear_shapes()) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert mixtral.moe_layers() == tuple(range(32)) and mixtral.router_shape() == (4096, 8)
    qwen15 = catalog.model(FIXTURES / "qwen1.5-moe-a2.7b.json", allow_moe=True)
    assert qwen15.shared_expert_gate and qwen15.shared_expert_intermediate_size == 5632
    assert qwen15.linear_shapes()["shared_expert_gate"] == (2048, 1)
    assert qwen15.attention_bias and not qwen15.attention_out_bias  # qkv_bias default True
    ds = catalog.model(FIXTURES / "deepseek-v3.json", allow_moe=True)
    assert ds.dense_layers == (0, 1, 2) and len(ds.moe_layers()) == 58
    assert ds.shared_expert_intermediate_size == 2048 and ds.head_dim == 192
    assert ds.linear_shapes()["kv_b_proj"] == (512, 128 * (128 + 128))
    assert ds.dense_layer_linear_shapes()["gate_proj"] == (7168, 18432)
    assert (
        MODELS["qwen3-30b-a3b"].num_params()
        == catalog.model(FIXTURES / "qwen3-30b-a3b.json", allow_moe=True).num_params()
    )


def test_moe_models_are_refused_where_experts_are_not_modelled():
    """Callers that do not model experts (no allow_moe=True) get MoE cards refused with their
    real counts, not a 7B dense model (the estimator models them: tests/test_estimate_moe.py)."""
    for name in (
        "mixtral-8x7b",
        "mistralai/Mixtral-8x7B-v0.1",
        str(FIXTURES / "mixtral-8x7b-v0.1.json"),
    ):
        with pytest.raises(catalog.UnsupportedArchitecture) as err:
            catalog.model(name)
        assert "46,702,792,704 parameters in total" in str(err.value)
        assert "12,879,925,248 active" in str(err.value)


def test_hf_moe_defaults_match_transformers():
    from transformers import DeepseekV3Config, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    classes = {"mixtral": MixtralConfig, "qwen2_moe": Qwen2MoeConfig,
               "qwen3_moe": Qwen3MoeConfig, "deepseek_v3": DeepseekV3Config}  # fmt: skip
    for model_type, cls in classes.items():
        cfg = cls()
        for key, value in hf_config._HF_DEFAULTS[model_type].items():
            assert getattr(cfg, key) == value, (model_type, key)


# ----------------------------------------------------------------------------- checkpoints


def _tiny_llama_dir(tmp_path: Path) -> tuple[Path, catalog.ModelArch]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                      max_position_embeddings=128, tie_word_embeddings=False)  # fmt: skip
    d = tmp_path / "tiny"
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    return d, catalog.model(d)


def test_checkpoint_matching_its_config_passes(tmp_path):
    d, arch = _tiny_llama_dir(tmp_path)
    assert (d / "model.safetensors").is_file()
    assert catalog.check_checkpoint(arch, d) == arch.num_params()


def test_checkpoint_disagreeing_with_config_is_refused(tmp_path):
    d, _ = _tiny_llama_dir(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 3  # the config now describes a layer the weights do not hold
    (d / "config.json").write_text(json.dumps(cfg))
    for arg in (d, d / "config.json"):
        with pytest.raises(catalog.UnsupportedArchitecture) as err:
            catalog.model(arg)
        assert str(d / "model.safetensors") in str(err.value)


def test_sharded_index_total_size_is_cross_checked(tmp_path):
    cfg = dict(LLAMA_SMALL, torch_dtype="bfloat16")
    d = _write(tmp_path, cfg)
    n = catalog.model(d / "config.json").num_params()
    index = d / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 2 * n}, "weight_map": {}}))
    assert catalog.check_checkpoint(catalog.model(d), d) == n
    index.write_text(json.dumps({"metadata": {"total_size": 2 * n * 105 // 100}, "weight_map": {}}))
    with pytest.raises(catalog.UnsupportedArchitecture) as err:
        catalog.model(d)
    assert str(index) in str(err.value) and "+5.0%" in str(err.value)
    # quantized weights: the dtype does not give bytes per parameter, nothing to compare
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "fp8"}}))
    assert catalog.check_checkpoint(catalog.model(d), d) is None


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b", "phi-4", "gemma-3-4b"])
def test_cards_round_trip_through_json(name):
    """memfit.estimate.trace.trace keys its cache by the card's JSON form and rebuilds the card in a child
    process: both must give back exactly the same card."""
    import dataclasses

    arch = MODELS[name]
    fields = json.loads(json.dumps(dataclasses.asdict(arch)))
    assert catalog.ModelArch(**fields) == arch  # tuples (aliases, layer_kind) come back as tuples
    assert catalog.ModelArch(**fields) == arch and hash(catalog.ModelArch(**fields)) == hash(arch)
    ds = catalog.model(FIXTURES / "deepseek-v3.json", allow_moe=True)
    assert catalog.ModelArch(**json.loads(json.dumps(dataclasses.asdict(ds)))) == ds
