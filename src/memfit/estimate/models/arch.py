"""A model's architecture card: `ModelArch`, the fields of a HF config.json that decide memory and
FLOPs of a decoder-only LM, with the parameter counts derived from them; and
`UnsupportedArchitecture`, what memfit refuses instead of guessing. Built from a config.json by
memfit.estimate.models.hf_config, looked up by name in memfit.estimate.models.catalog."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memfit.estimate.errors import UnsupportedArchitecture

__all__ = ["ModelArch", "UnsupportedArchitecture"]


@dataclass(frozen=True)
class ModelArch:
    """The fields of a HF config.json that decide memory and FLOPs of a decoder-only LM."""

    name: str  # catalog name or the path it was read from
    model_type: str  # HF model_type: llama, mistral, qwen2, qwen3, gemma3_text, glm, chatglm ...
    hidden_size: int
    # Dense MLP inner width (gated MLPs have gate+up+down of this width). MoE models: the width of
    # their dense layers' MLPs (`dense_layers`); Mixtral has none and its config's
    # intermediate_size is the expert width (also in moe_intermediate_size).
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int  # GQA/MQA key-value heads (== num_attention_heads for MHA)
    head_dim: int  # may differ from hidden_size // heads (Gemma-3, Qwen3); MLA: nope + rope
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
    fused_gate_up: bool = False  # gate and up in one Linear(h, 2*I) (GLM-4, Phi-3: gate_up_proj)
    norms_per_layer: int = 2  # RMSNorms of width hidden_size per decoder layer (Gemma-3: 4)
    sliding_window_pattern: int | None = None  # every Nth layer global, rest local (Gemma-3: 6)
    vision_params: int = 0  # checkpoint params outside the text tower (not in num_params)
    hf_repo: str = ""  # the HF repository the card was taken from ("" for local configs)
    aliases: tuple[str, ...] = ()  # other lowercase names users type for this catalog entry
    fused_qkv: bool = False  # q, k, v in one Linear(h, (heads + 2 kv) * d) (Phi-3: qkv_proj)
    # --- mixture-of-experts (all 0 / () for dense models) ---
    # Routed experts per MoE layer (Mixtral num_local_experts, Qwen-MoE num_experts, DeepSeek
    # n_routed_experts); each is a gated MLP of width moe_intermediate_size. transformers >= 5
    # stores them as two 3D parameters per layer: experts.gate_up_proj (E, 2*I_e, h) and
    # experts.down_proj (E, h, I_e) (modeling_mixtral.MixtralExperts, Qwen2MoeExperts,
    # Qwen3MoeExperts, DeepseekV3Experts).
    num_experts: int = 0
    num_experts_per_tok: int = 0  # routed experts each token goes through (top-k)
    moe_intermediate_size: int = 0  # one routed expert's MLP width
    # Always-on shared expert, a gated MLP of this width in every MoE layer: Qwen2-MoE
    # shared_expert_intermediate_size; DeepSeek moe_intermediate_size * n_shared_experts (its
    # shared experts are one DeepseekV3MLP of that width). 0: none (Mixtral, Qwen3-MoE).
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(Linear(h, 1)) scales the shared expert
    # Layers of an MoE model whose MLP is dense (width intermediate_size): DeepSeek's first
    # first_k_dense_replace layers, Qwen-MoE's mlp_only_layers and the layers decoder_sparse_step
    # skips. Every other layer is an MoE layer with a router Linear(h, E, bias=False) stored as
    # an nn.Parameter (E, h) (MixtralTopKRouter, Qwen2MoeTopKRouter, DeepseekV3TopkRouter).
    # Bit i set: layer i is dense; read it as `dense_layers`. An int, so the card stays hashable
    # and its JSON form (memfit.estimate.trace.trace's cache keys and child processes) round-trips exactly.
    dense_layer_mask: int = 0
    # --- multi-head latent attention (DeepSeek-V3, modeling_deepseek_v3.DeepseekV3Attention);
    # kv_lora_rank == 0: ordinary attention ---
    q_lora_rank: int = 0  # 0 with MLA: one q_proj instead of q_a_proj/q_a_layernorm/q_b_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # --- read from transformers (memfit.estimate.models.inventory) instead of hand-modelled ---
    # The config.json (the text model's, for a multimodal wrapper) as canonical JSON, for every
    # model_type without a hand-written card: the parameters come from the model transformers
    # builds from it on the meta device, the activations from a traced step of it. "" for the
    # hand-modelled types (hf_config.SUPPORTED_MODEL_TYPES).
    hf_config: str = ""
    # A generic card standing for one kind of its model's decoder layers (generic.layer_groups):
    # the indices of two layers of that kind (the same index twice when there is one); the trace
    # builds the model up to them and keeps only them. () for the whole model.
    layer_kind: tuple[int, ...] = ()
    # A reward model (method rm: `AutoModelForSequenceClassification`, num_labels=1): the vocabulary
    # head replaced by a one-output score Linear(h, 1, bias=False) (modeling_llama
    # LlamaForSequenceClassification.score), untied. Set by memfit.estimate.memory.method_terms.method_arch.
    score_head: bool = False

    def __post_init__(self) -> None:
        # JSON round trips (memfit.estimate.trace.trace sends the card to a child process) give lists.
        object.__setattr__(self, "aliases", tuple(self.aliases))
        object.__setattr__(self, "layer_kind", tuple(self.layer_kind))

    # ------------------------------------------------------------------ structure

    @property
    def generic(self) -> bool:
        """Parameters read from transformers' own model, not from this card's formulas."""
        return bool(self.hf_config)

    def inventory(self) -> Any:
        """The parameters of the model transformers builds from `hf_config` (memfit.estimate.
        inventory.Inventory); generic cards only."""
        from memfit.estimate.models import inventory

        if not self.hf_config:
            raise ValueError(f"{self.name}: a hand-modelled card has no transformers inventory")
        return inventory.inventory(self.hf_config, self.source or self.name)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def uses_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """MoE models: indices of the layers with a dense MLP (see dense_layer_mask)."""
        return tuple(i for i in range(self.num_layers) if self.dense_layer_mask >> i & 1)

    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the decoder layers with routed experts (empty for dense models)."""
        if not self.is_moe:
            return ()
        return tuple(i for i in range(self.num_layers) if not self.dense_layer_mask >> i & 1)

    def attention_linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of the attention's linear layers, by HF module name."""
        h, d = self.hidden_size, self.head_dim
        q_out, kv_out = self.num_attention_heads * d, self.num_kv_heads * d
        if self.model_type == "chatglm":
            return {"query_key_value": (h, q_out + 2 * kv_out), "dense": (q_out, h)}
        if self.uses_mla:
            # DeepseekV3Attention: queries through a rank-q_lora_rank bottleneck (or one q_proj),
            # keys/values through the shared latent of width kv_lora_rank (+ the rotary key part).
            heads, qk = self.num_attention_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
            shapes: dict[str, tuple[int, int]] = {}
            if self.q_lora_rank:
                shapes["q_a_proj"] = (h, self.q_lora_rank)
                shapes["q_b_proj"] = (self.q_lora_rank, heads * qk)
            else:
                shapes["q_proj"] = (h, heads * qk)
            shapes["kv_a_proj_with_mqa"] = (h, self.kv_lora_rank + self.qk_rope_head_dim)
            shapes["kv_b_proj"] = (
                self.kv_lora_rank,
                heads * (self.qk_nope_head_dim + self.v_head_dim),
            )
            shapes["o_proj"] = (heads * self.v_head_dim, h)
            return shapes
        if self.fused_qkv:  # Phi3Attention.qkv_proj
            return {"qkv_proj": (h, q_out + 2 * kv_out), "o_proj": (q_out, h)}
        return {
            "q_proj": (h, q_out),
            "k_proj": (h, kv_out),
            "v_proj": (h, kv_out),
            "o_proj": (q_out, h),
        }

    def mlp_linear_shapes(self, width: int | None = None) -> dict[str, tuple[int, int]]:
        """Linear layers of one dense MLP of `width` (default intermediate_size)."""
        h, inter = self.hidden_size, self.intermediate_size if width is None else width
        if self.model_type == "chatglm":
            return {"dense_h_to_4h": (h, 2 * inter), "dense_4h_to_h": (inter, h)}
        shapes: dict[str, tuple[int, int]] = {}
        if self.fused_gate_up:
            shapes["gate_up_proj"] = (h, 2 * inter)
        elif self.gated_mlp:
            shapes["gate_proj"] = (h, inter)
            shapes["up_proj"] = (h, inter)
        else:
            shapes["up_proj"] = (h, inter)
        shapes["down_proj"] = (inter, h)
        return shapes

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every nn.Linear in one decoder layer, by HF module name
        (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj): what LoRA targets.

        GLM-4 (model_type glm) and Phi-3 fuse gate and up into `gate_up_proj`; Phi-3 also fuses
        q/k/v into `qkv_proj`; the original THUDM ChatGLM code (model_type chatglm) names them
        `query_key_value`, `dense`, `dense_h_to_4h`, `dense_4h_to_h` (modeling_chatglm.py in
        THUDM/glm-4-9b-chat). DeepSeek-V3's MLA has q_a_proj, q_b_proj, kv_a_proj_with_mqa,
        kv_b_proj, o_proj. The embedding and lm_head are not included (PEFT's "all-linear" also
        leaves lm_head out).

        MoE models: the nn.Linear modules of an MoE layer (`moe_layers()`), i.e. the attention,
        plus the shared expert's gate/up/down_proj and Qwen2-MoE's shared_expert_gate (h, 1).
        The routed experts are not nn.Linear (3D parameters, see `expert_linear_shapes()`), nor
        is the router (`router_shape()`). Dense layers of an MoE model (`dense_layers`) hold
        `dense_layer_linear_shapes()` instead.
        """
        if not self.is_moe:
            return {**self.attention_linear_shapes(), **self.mlp_linear_shapes()}
        shapes = self.attention_linear_shapes()
        if self.shared_expert_intermediate_size:
            shapes.update(self.mlp_linear_shapes(self.shared_expert_intermediate_size))
        if self.shared_expert_gate:
            shapes["shared_expert_gate"] = (self.hidden_size, 1)
        return shapes

    def dense_layer_linear_shapes(self) -> dict[str, tuple[int, int]]:
        """nn.Linear shapes of a decoder layer with a dense MLP of width intermediate_size (every
        layer of a dense model; the `dense_layers` of an MoE model)."""
        return {**self.attention_linear_shapes(), **self.mlp_linear_shapes()}

    def expert_linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of ONE routed expert's projections, named like transformers' 3D expert
        parameters: gate_up_proj (h -> 2*I_e, gate and up fused) and down_proj (I_e -> h).
        Each MoE layer holds num_experts of them; a token runs through num_experts_per_tok.
        Empty for dense models."""
        if not self.is_moe:
            return {}
        h, inter = self.hidden_size, self.moe_intermediate_size
        return {"gate_up_proj": (h, 2 * inter), "down_proj": (inter, h)}

    def expert_params(self) -> int:
        """Parameters of one routed expert (no biases in any supported MoE)."""
        if self.generic:
            inv = self.inventory()
            return inv.expert_numel // max(1, inv.num_experts * len(self.moe_layers()))
        return sum(i * o for i, o in self.expert_linear_shapes().values())

    def router_shape(self) -> tuple[int, int]:
        """(in, out) of an MoE layer's router: logits = x @ weight.T, weight (E, h); (0, 0) dense."""
        return (self.hidden_size, self.num_experts) if self.is_moe else (0, 0)

    # ------------------------------------------------------------------ counts

    def _attention_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        n = sum(i * o for i, o in self.attention_linear_shapes().values())
        if self.uses_mla:
            # DeepseekV3Attention: q_a_layernorm (q_lora_rank) and kv_a_layernorm (kv_lora_rank);
            # attention_bias puts biases on q_a_proj, kv_a_proj_with_mqa and o_proj.
            n += self.q_lora_rank + self.kv_lora_rank
            if self.attention_bias:
                n += self.q_lora_rank + self.kv_lora_rank + self.qk_rope_head_dim + h
            return n
        q_out, kv_out = self.num_attention_heads * d, self.num_kv_heads * d
        if self.attention_bias:  # bias on q, k, v (Qwen2 q/k/v_proj; ChatGLM query_key_value)
            n += q_out + 2 * kv_out
        if self.attention_out_bias:  # bias on o_proj
            n += h
        if self.qk_norm:  # q_norm and k_norm are RMSNorm(head_dim), shared across heads
            n += 2 * d
        return n

    def _dense_mlp_params(self, width: int) -> int:
        n = sum(i * o for i, o in self.mlp_linear_shapes(width).values())
        if self.mlp_bias:  # bias on every MLP projection: gate+up (2*I) and down (h)
            n += (2 if self.gated_mlp else 1) * width + self.hidden_size
        return n

    def _moe_mlp_params(self) -> int:
        h = self.hidden_size
        n = self.num_experts * self.expert_params() + self.num_experts * h  # experts + router
        if self.shared_expert_intermediate_size:
            n += self._dense_mlp_params(self.shared_expert_intermediate_size)
        if self.shared_expert_gate:
            n += h
        return n

    def layer_params(self, layer: int = 0) -> int:
        """Parameters of decoder layer `layer` (norms and biases included)."""
        if self.generic:
            return self.inventory().layer_numel(layer)
        mlp = (
            self._moe_mlp_params()
            if self.is_moe and not self.dense_layer_mask >> layer & 1
            else self._dense_mlp_params(self.intermediate_size)
        )
        # RMSNorm weights only (no bias) in all these models
        return self._attention_params() + mlp + self.norms_per_layer * self.hidden_size

    def num_params(self) -> int:
        """Exact parameter count of the HF implementation (embeddings, layers, norms, lm_head).

        Counts what `AutoModelForCausalLM.from_config(self.to_hf_config())` holds, with tied
        embeddings counted once; for MoE models every expert (the total, what the weights,
        gradients and optimizer states of full fine-tuning hold). For multimodal checkpoints
        (Gemma-3 4b+) this is the text tower only; `vision_params` holds the rest. Module shapes
        follow transformers' modeling_llama, modeling_qwen2, modeling_qwen3, modeling_gemma3,
        modeling_glm, modeling_phi3, modeling_mixtral, modeling_qwen2_moe, modeling_qwen3_moe and
        modeling_deepseek_v3; the test suite checks the sum against the real modules on the meta
        device for every catalog model. Buffers are not parameters (DeepSeek's router
        e_score_correction_bias, E floats per MoE layer, is a buffer). Generic cards: what
        transformers builds, counted (`inventory`).
        """
        if self.generic:
            return self.inventory().total
        h = self.hidden_size
        embeddings = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h  # Linear(h, V, bias=False)
        if self.score_head:  # a reward model's score: Linear(h, 1, bias=False)
            lm_head = h
        final_norm = h
        layers = sum(self.layer_params(i) for i in range(self.num_layers))
        return embeddings + layers + final_norm + lm_head

    def num_active_params(self) -> int:
        """Parameters one token runs through: num_params() less the routed experts it skips
        (num_experts - num_experts_per_tok per MoE layer); == num_params() for dense models.
        The embedding row lookup is counted whole, as the published "active" figures do
        (Mixtral-8x7B: 12.9B of 46.7B, mistral.ai/news/mixtral-of-experts). Use it for FLOPs
        and per-token compute; memory for weights, gradients and optimizer states needs
        num_params() (every expert is resident)."""
        if self.generic:
            return self.num_params() - self.inventory().inactive
        skipped = self.num_experts - self.num_experts_per_tok
        return self.num_params() - len(self.moe_layers()) * skipped * self.expert_params()

    @property
    def hf_model_type(self) -> str:
        """The transformers model_type whose implementation matches this card (arch_to_hf)."""
        from memfit.estimate.models.arch_to_hf import hf_model_type

        return hf_model_type(self)

    def to_hf_config(self) -> Any:
        """A `transformers.PretrainedConfig` for this architecture (arch_to_hf.to_hf_config)."""
        from memfit.estimate.models.arch_to_hf import to_hf_config

        return to_hf_config(self)
