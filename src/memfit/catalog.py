"""What hardware and models exist: the GPU catalog and model architecture cards.

Data lives in `config/gpus.yaml` and `config/models.yaml` (each figure with its
source); this module loads it into frozen dataclasses and resolves user input:
a catalog name, a path to a HF `config.json`, or a model directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Repository-relative catalog files; overridable for tests via the `root` arguments.
REPO_ROOT = Path(__file__).resolve().parents[2]
GPUS_YAML = REPO_ROOT / "config" / "gpus.yaml"
MODELS_YAML = REPO_ROOT / "config" / "models.yaml"


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

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / 2**30


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

    def num_params(self) -> int:
        """Exact parameter count of the HF implementation (embeddings, layers, norms, lm_head)."""
        raise NotImplementedError  # filled in by the catalog work

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every linear layer in one decoder layer, by HF module name
        (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj): what LoRA targets."""
        raise NotImplementedError


def load_gpus(path: Path = GPUS_YAML) -> dict[str, GPU]:
    raise NotImplementedError


def gpu(name: str, path: Path = GPUS_YAML) -> GPU:
    """Look up a GPU by catalog name; unknown names raise ValueError listing the allowed ones."""
    raise NotImplementedError


def load_models(path: Path = MODELS_YAML) -> dict[str, ModelArch]:
    raise NotImplementedError


def model(name_or_path: str | Path, path: Path = MODELS_YAML) -> ModelArch:
    """A catalog name, a path to a HF config.json, or a model directory containing one."""
    raise NotImplementedError
