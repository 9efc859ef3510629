"""What hardware and models exist: the GPU catalog and model architecture cards.

Data lives in `config/gpus.yaml` and `config/models.yaml` (each figure with its
source); this module loads it into frozen dataclasses and resolves user input:
a catalog name, a path to a HF `config.json`, or a model directory.

The model catalog stores the published `config.json` fields verbatim, so catalog
entries and user-supplied config files go through one parser (`arch_from_hf_config`).
Nothing here downloads anything: a HF hub id that is not a catalog name is an error.

    >>> from memfit import catalog
    >>> catalog.model("llama-2-7b").num_params()
    6738415616
    >>> catalog.gpu("a100-80gb").memory_gib
    80.0
"""

from __future__ import annotations

import difflib
import json
from dataclasses import MISSING, dataclass, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

# Repository-relative catalog files; overridable for tests via the `root` arguments.
REPO_ROOT = Path(__file__).resolve().parents[2]
GPUS_YAML = REPO_ROOT / "config" / "gpus.yaml"
MODELS_YAML = REPO_ROOT / "config" / "models.yaml"

MIB = 2**20


@dataclass(frozen=True)
class GPU:
    """One accelerator kind (or `cpu`, the host). Bytes are what nvidia-smi reports as total."""

    name: str  # lowercase catalog name, e.g. "a100-80gb"
    memory_bytes: int  # device memory total as nvidia-smi reports it (MiB * 2**20)
    bf16: bool  # hardware bf16 support (Ampere and newer)
    flash_attn2: bool  # FlashAttention-2 supports this architecture (sm80+ ; not V100/T4)
    compute_capability: str  # e.g. "8.0"
    tflops_bf16: float  # peak dense bf16 tensor TFLOP/s (no sparsity); 0 when unsupported
    tflops_fp16: float  # peak dense fp16 tensor TFLOP/s (no sparsity)
    tflops_fp32: float  # peak fp32 TFLOP/s (non-tensor)
    memory_bandwidth_gbs: float  # device memory bandwidth, GB/s
    host_link_gbs: float  # host<->device bandwidth per direction, GB/s (PCIe gen x16)
    interconnect_gbs: float  # GPU<->GPU bandwidth per direction inside a node, GB/s (NVLink or PCIe)
    typical_gpus_per_node: int  # the common server/workstation configuration
    typical_host_memory_gb: float  # host RAM per node in that configuration (GB), default for --host-memory-gb
    source: str  # vendor spec URL(s) the figures come from
    interconnect_kind: str = "pcie"  # "nvlink", "pcie", or "host" (the cpu entry)
    aliases: tuple[str, ...] = ()  # other lowercase names users type for this entry

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / 2**30

    def tflops(self, precision: str) -> float:
        """Peak dense TFLOP/s for a training precision ("bf16", "fp16", "fp32")."""
        try:
            return {"bf16": self.tflops_bf16, "fp16": self.tflops_fp16, "fp32": self.tflops_fp32}[
                precision
            ]
        except KeyError:
            raise ValueError(f"unknown precision {precision!r}: use bf16, fp16 or fp32") from None


@dataclass(frozen=True)
class ModelArch:
    """The fields of a HF config.json that decide memory and FLOPs of a decoder-only LM."""

    name: str  # catalog name or the path it was read from
    model_type: str  # HF model_type: llama, mistral, qwen2, qwen3, gemma3_text, glm, chatglm ...
    hidden_size: int
    intermediate_size: int  # MLP inner width (gated MLPs have gate+up+down of this width)
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int  # GQA/MQA key-value heads (== num_attention_heads for MHA)
    head_dim: int  # may differ from hidden_size // heads (Gemma-3, Qwen3)
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    gated_mlp: bool = True  # SwiGLU/GeGLU: 3 matrices; False: 2 (up, down)
    attention_bias: bool = False  # q/k/v projection biases (Qwen2/2.5, GLM-4)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, Gemma-3)
    sliding_window: int | None = None  # local attention window where the model uses one
    source: str = ""  # HF config URL or local path
    # --- added by the catalog work (all defaulted, so existing constructors keep working) ---
    attention_out_bias: bool = False  # o_proj bias (Llama's attention_bias covers o_proj too)
    mlp_bias: bool = False  # biases on the MLP projections (Llama's mlp_bias)
    fused_gate_up: bool = False  # gate and up in one Linear(h, 2*I) (GLM-4: gate_up_proj)
    norms_per_layer: int = 2  # RMSNorms of width hidden_size per decoder layer (Gemma-3: 4)
    sliding_window_pattern: int | None = None  # every Nth layer global, rest local (Gemma-3: 6)
    vision_params: int = 0  # checkpoint params outside the text tower (not in num_params)
    hf_repo: str = ""  # the HF repository the card was taken from ("" for local configs)
    aliases: tuple[str, ...] = ()  # other lowercase names users type for this catalog entry

    def num_params(self) -> int:
        """Exact parameter count of the HF implementation (embeddings, layers, norms, lm_head).

        Counts what `AutoModelForCausalLM.from_config(self.to_hf_config())` holds, with tied
        embeddings counted once. For multimodal checkpoints (Gemma-3 4b+) this is the text tower
        only; `vision_params` holds the rest. Module shapes follow transformers' modeling_llama,
        modeling_qwen2, modeling_qwen3, modeling_gemma3 and modeling_glm; the test suite checks
        the sum against the real modules on the meta device for every catalog model.
        """
        h, d = self.hidden_size, self.head_dim
        per_layer = sum(i * o for i, o in self.linear_shapes().values())
        q_out, kv_out = self.num_attention_heads * d, self.num_kv_heads * d
        if self.attention_bias:  # bias on q, k, v (Qwen2 q/k/v_proj; ChatGLM query_key_value)
            per_layer += q_out + 2 * kv_out
        if self.attention_out_bias:  # bias on o_proj
            per_layer += h
        if self.mlp_bias:  # bias on every MLP projection: gate+up (2*I) and down (h)
            per_layer += (2 if self.gated_mlp else 1) * self.intermediate_size + h
        per_layer += self.norms_per_layer * h  # RMSNorm weights only (no bias) in all these models
        if self.qk_norm:  # q_norm and k_norm are RMSNorm(head_dim), shared across heads
            per_layer += 2 * d
        embeddings = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h  # Linear(h, V, bias=False)
        final_norm = h
        return embeddings + self.num_layers * per_layer + final_norm + lm_head

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every linear layer in one decoder layer, by HF module name
        (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj): what LoRA targets.

        GLM-4 (model_type glm) fuses gate and up into `gate_up_proj`; the original THUDM ChatGLM
        code (model_type chatglm) names them `query_key_value`, `dense`, `dense_h_to_4h`,
        `dense_4h_to_h` (modeling_chatglm.py in THUDM/glm-4-9b-chat). The embedding and lm_head
        are not included (PEFT's "all-linear" also leaves lm_head out).
        """
        h, inter = self.hidden_size, self.intermediate_size
        q_out, kv_out = self.num_attention_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.model_type == "chatglm":
            return {
                "query_key_value": (h, q_out + 2 * kv_out),
                "dense": (q_out, h),
                "dense_h_to_4h": (h, 2 * inter),
                "dense_4h_to_h": (inter, h),
            }
        shapes = {
            "q_proj": (h, q_out),
            "k_proj": (h, kv_out),
            "v_proj": (h, kv_out),
            "o_proj": (q_out, h),
        }
        if self.fused_gate_up:
            shapes["gate_up_proj"] = (h, 2 * inter)
        elif self.gated_mlp:
            shapes["gate_proj"] = (h, inter)
            shapes["up_proj"] = (h, inter)
        else:
            shapes["up_proj"] = (h, inter)
        shapes["down_proj"] = (inter, h)
        return shapes

    @property
    def hf_model_type(self) -> str:
        """The transformers model_type whose implementation matches this card."""
        if self.model_type in _HF_IMPLEMENTED:
            return self.model_type
        if self.model_type == "chatglm":
            # transformers has no chatglm; GlmForCausalLM is its port with identical parameter
            # counts (convert_glm_weights_to_hf.py splits query_key_value into q/k/v).
            return "glm"
        if self.qk_norm:
            return "qwen3"
        if self.attention_bias and not self.attention_out_bias:
            return "qwen2"
        return "llama"

    def to_hf_config(self) -> Any:
        """A `transformers.PretrainedConfig` for this architecture (AutoConfig.for_model).

        Build the model without allocating: `with torch.device("meta"):
        AutoModelForCausalLM.from_config(arch.to_hf_config())`. Multimodal Gemma-3 cards give the
        text-only `gemma3_text` config (Gemma3ForCausalLM).
        """
        from transformers import AutoConfig  # heavy import, only when asked

        mt = self.hf_model_type
        kwargs: dict[str, Any] = dict(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
        )
        if mt in ("llama", "qwen3", "glm", "gemma3_text"):
            kwargs["attention_bias"] = self.attention_bias
        if mt == "llama":
            kwargs["mlp_bias"] = self.mlp_bias
        if mt in ("mistral", "gemma3_text") and self.sliding_window is not None:
            kwargs["sliding_window"] = self.sliding_window
        if mt == "gemma3_text" and self.sliding_window_pattern is not None:
            kwargs["sliding_window_pattern"] = self.sliding_window_pattern
        if mt in ("qwen2", "qwen3"):
            kwargs["use_sliding_window"] = self.sliding_window is not None
            kwargs["sliding_window"] = self.sliding_window
        return AutoConfig.for_model(mt, **kwargs)


# model_types whose transformers implementation this module mirrors exactly.
_HF_IMPLEMENTED = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "glm")


# ----------------------------------------------------------------------------- GPUs


def _required(cls: type) -> list[str]:
    return [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]


@lru_cache(maxsize=8)
def _load_gpus_cached(path: Path) -> dict[str, GPU]:
    raw = _read_yaml(path)
    out: dict[str, GPU] = {}
    known = {f.name for f in fields(GPU)} | {"memory_mib"}
    for name, entry in raw.items():
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: entry {name!r} is not a mapping")
        unknown = set(entry) - known
        if unknown:
            raise ValueError(f"{path}: entry {name!r} has unknown fields {sorted(unknown)}")
        values = dict(entry)
        # The YAML holds the nvidia-smi figure in MiB; the dataclass holds bytes.
        if "memory_mib" in values:
            values["memory_bytes"] = int(values.pop("memory_mib")) * MIB
        values["name"] = name
        values["aliases"] = tuple(str(a).lower() for a in values.get("aliases", ()))
        missing = [f for f in _required(GPU) if f not in values]
        if missing:
            raise ValueError(f"{path}: GPU {name!r} is missing {missing}")
        values["compute_capability"] = str(values["compute_capability"])
        out[name] = GPU(**values)
    return out


def load_gpus(path: Path = GPUS_YAML) -> dict[str, GPU]:
    """All GPU catalog entries by lowercase name (a fresh dict; the GPUs are frozen)."""
    return dict(_load_gpus_cached(Path(path)))


def gpu(name: str, path: Path = GPUS_YAML) -> GPU:
    """Look up a GPU by catalog name; unknown names raise ValueError listing the allowed ones."""
    gpus = _load_gpus_cached(Path(path))
    return _lookup(gpus, name, "GPU", path)


# ----------------------------------------------------------------------------- models


@lru_cache(maxsize=8)
def _load_models_cached(path: Path) -> dict[str, ModelArch]:
    raw = _read_yaml(path)
    out: dict[str, ModelArch] = {}
    for name, entry in raw.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("config"), dict):
            raise ValueError(f"{path}: model {name!r} needs a `config:` mapping of config.json")
        where = f"{path} [{name}]"
        arch = arch_from_hf_config(entry["config"], name=name, where=where)
        out[name] = replace(
            arch,
            source=str(entry.get("source", "")),
            hf_repo=str(entry.get("hf_repo", "")),
            aliases=tuple(str(a).lower() for a in entry.get("aliases", ())),
        )
    return out


def load_models(path: Path = MODELS_YAML) -> dict[str, ModelArch]:
    """All model cards by lowercase catalog name (a fresh dict; the cards are frozen)."""
    return dict(_load_models_cached(Path(path)))


def model(name_or_path: str | Path, path: Path = MODELS_YAML) -> ModelArch:
    """A catalog name, a path to a HF config.json, or a model directory containing one."""
    text = str(name_or_path).strip()
    models = _load_models_cached(Path(path))
    # A bare catalog name wins over a same-named directory in the working directory; use
    # "./name" to force the path.
    looks_like_path = isinstance(name_or_path, Path) or "/" in text or "\\" in text
    if not looks_like_path and _resolve(models, text) is not None:
        return _lookup(models, text, "model", path)
    p = Path(text).expanduser()
    if p.is_dir():
        cfg = p / "config.json"
        if not cfg.is_file():
            raise ValueError(f"{p}: directory has no config.json")
        return model_from_config_file(cfg)
    if p.is_file():
        return model_from_config_file(p)
    # A HF hub id of a catalog model ("Qwen/Qwen2.5-7B-Instruct") resolves to its card.
    for card in models.values():
        if card.hf_repo and card.hf_repo.lower() == text.lower():
            return card
    if looks_like_path or text.endswith(".json"):
        raise ValueError(
            f"{text!r}: no such file or directory, and not a catalog model. memfit never "
            f"downloads from the HF hub: pass a local model directory or its config.json, "
            f"or one of: {', '.join(sorted(models))}"
        )
    return _lookup(models, text, "model", path)


def model_from_config_file(config_json: str | Path) -> ModelArch:
    """Parse a HF config.json file (any supported style) into a ModelArch named by its path."""
    p = Path(config_json)
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{p}: expected a JSON object")
    return arch_from_hf_config(cfg, name=str(p), where=str(p), source=str(p.resolve()))


# Class defaults transformers fills in when a config.json omits a field. The published Gemma-3
# 4b/12b/27b config.json files are sparse (google/gemma-3-4b-it's text_config lists only
# hidden_size, intermediate_size, num_hidden_layers, rope_scaling, sliding_window), so loading
# them needs these. Values from Gemma3TextConfig.__init__ in transformers
# (src/transformers/models/gemma3/configuration_gemma3.py); tests/test_catalog.py checks them
# against the installed transformers. Only fields transformers really defaults are listed: the
# core sizes (hidden_size, intermediate_size, num_hidden_layers) stay required.
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
}

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


def arch_from_hf_config(
    cfg: dict[str, Any], name: str, where: str = "", source: str = ""
) -> ModelArch:
    """Build a ModelArch from the fields of a HF config.json (already parsed).

    Supports llama, mistral, qwen2, qwen3, gemma3 (multimodal, nested `text_config`) and
    gemma3_text, glm (glm-4-*-hf), chatglm (original THUDM field names) and any llama-like
    config with the standard field names. `where` names the file in error messages.
    """
    where = where or name
    model_type = str(cfg.get("model_type", "")).lower()
    if model_type == "chatglm" or "padded_vocab_size" in cfg or "multi_query_group_num" in cfg:
        return _from_chatglm(cfg, name, where, source)
    vision_params = 0
    if isinstance(cfg.get("text_config"), dict):
        # Multimodal wrapper (Gemma-3 4b+): the LM is the nested text_config; count the rest.
        text = dict(cfg["text_config"])
        if model_type == "gemma3":
            text.setdefault("model_type", "gemma3_text")
            if isinstance(cfg.get("vision_config"), dict):
                vision_params = _gemma3_vision_params(cfg, text, where)
        cfg, model_type = text, str(text.get("model_type", model_type)).lower()
    if model_type == "gemma3":  # text-only gemma3 config without a text_config
        model_type = "gemma3_text"
    defaults = _HF_DEFAULTS.get(model_type, {})

    def get(key: str, *alts: str, default: Any = MISSING) -> Any:
        for k in (key, *alts):
            if cfg.get(k) is not None:
                return cfg[k]
        if key in defaults:
            return defaults[key]
        if default is not MISSING:
            return default
        raise ValueError(f"{where}: config.json is missing {key!r} (the estimate needs it)")

    hidden = int(get("hidden_size", "n_embd", "d_model"))
    heads = int(get("num_attention_heads", "n_head"))
    # HF (LlamaConfig, MistralConfig, Qwen2Config ...): num_key_value_heads defaults to
    # num_attention_heads (MHA) and head_dim to hidden_size // num_attention_heads.
    kv_heads = int(get("num_key_value_heads", default=heads))
    head_dim = int(get("head_dim", default=hidden // heads))
    gemma = model_type == "gemma3_text"
    qwen2 = model_type == "qwen2"
    # Qwen2 hard-codes bias=True on q/k/v and False on o_proj (modeling_qwen2.Qwen2Attention);
    # its config.json has no attention_bias field.
    qkv_bias = True if qwen2 else bool(get("attention_bias", default=False))
    # o_proj follows attention_bias in llama, qwen3 and gemma3; never in qwen2 and glm.
    out_bias = qkv_bias and model_type not in ("qwen2", "glm")
    if model_type == "mistral":  # MistralAttention has no biases at all
        qkv_bias = out_bias = False
    # Qwen2/Qwen3 only use sliding_window when use_sliding_window is true (Qwen2Config sets it to
    # None otherwise); Mistral v0.1 and Gemma-3 use it as given.
    window = get("sliding_window", default=None)
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None
    if model_type in ("llama", "glm"):
        window = None
    pattern = None
    if gemma:
        pattern = int(get("sliding_window_pattern", "_sliding_window_pattern"))
    # Unknown llama-like model_types: assume untied (an extra V*h lm_head; errs towards more memory).
    tie = bool(get("tie_word_embeddings", default=False))
    return ModelArch(
        name=name,
        model_type=model_type or "llama",
        hidden_size=hidden,
        intermediate_size=int(get("intermediate_size", "ffn_hidden_size", "n_inner")),
        num_layers=int(get("num_hidden_layers", "num_layers", "n_layer")),
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=int(get("vocab_size")),
        max_position_embeddings=int(get("max_position_embeddings", "seq_length", "n_positions")),
        tie_word_embeddings=tie,
        gated_mlp=True,
        attention_bias=qkv_bias,
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        sliding_window=int(window) if window is not None else None,
        source=source,
        attention_out_bias=out_bias,
        mlp_bias=bool(get("mlp_bias", default=False)) if model_type == "llama" else False,
        fused_gate_up=model_type == "glm",
        norms_per_layer=4 if gemma else 2,  # Gemma3DecoderLayer: input, post_attention,
        # pre_feedforward and post_feedforward layernorms
        sliding_window_pattern=pattern,
        vision_params=vision_params,
    )


def _from_chatglm(cfg: dict[str, Any], name: str, where: str, source: str) -> ModelArch:
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


def _gemma3_vision_params(cfg: dict[str, Any], text: dict[str, Any], where: str) -> int:
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


# ----------------------------------------------------------------------------- helpers


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"catalog file not found: {path}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of name -> entry")
    return {str(k).lower(): v for k, v in data.items()}


def _resolve(catalog: dict[str, Any], name: str) -> str | None:
    key = name.strip().lower()
    if key in catalog:
        return key
    for canonical, entry in catalog.items():
        if key in entry.aliases:
            return canonical
    return None


def _lookup(catalog: dict[str, Any], name: str, what: str, path: Path) -> Any:
    key = _resolve(catalog, name)
    if key is not None:
        return catalog[key]
    allowed = sorted(catalog)
    candidates = allowed + [a for e in catalog.values() for a in e.aliases]
    close = difflib.get_close_matches(name.strip().lower(), candidates, n=1, cutoff=0.5)
    hint = f" Did you mean {_resolve(catalog, close[0])!r}?" if close else ""
    raise ValueError(f"unknown {what} {name!r}.{hint} Allowed ({path.name}): {', '.join(allowed)}")
