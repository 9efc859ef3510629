"""The parameters of an architecture, in HF module order (`param_layout`: per layer, embeddings,
head, experts), which of them train (`trainable_params`), and the linears LoRA adapts
(`lora_targets`, `lora_adapts_experts`: peft's defaults per architecture)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from memfit.estimate.models.arch import ModelArch
from memfit.estimate.settings import EstimateError, Settings
from memfit.space import Candidate


@dataclass(frozen=True)
class ParamLayout:
    total: int  # every parameter, tied embeddings once (MoE: every routed expert)
    embed: int  # V*h
    lm_head: int  # V*h, 0 when tied; a reward model's score head: h (ModelArch.score_head)
    per_layer: int  # one decoder layer, norms and biases included (MoE: the largest layer)
    layer_tensors: tuple[int, ...]  # numel of each parameter tensor of one decoder layer
    linear_shapes: tuple[tuple[str, int, int], ...]  # (name, in, out) per decoder layer
    largest_module: int  # DS `model_to_params`: largest params of a single module (recurse=False)
    # Mixture-of-experts (empty/0 for dense models): numel of each parameter tensor of every
    # decoder layer in module order (dense and MoE layers differ), the nn.Linear shapes of the
    # dense layers of an MoE model, and the parameters of the routed experts each token skips.
    layers: tuple[tuple[int, ...], ...] = ()
    dense_linear_shapes: tuple[tuple[str, int, int], ...] = ()
    inactive: int = 0  # num_params() - num_active_params()
    # Generic cards (read from transformers, memfit.estimate.models.inventory): every parameter
    # tensor's numel in module order, and per decoder layer its modules as ZeRO-3 gathers
    # them, (numel, 4-bit under QLoRA: an nn.Linear or fused experts), and its linears (name, in, out).
    order: tuple[int, ...] = ()
    units: tuple[tuple[tuple[int, bool], ...], ...] = ()
    layer_linears: tuple[tuple[tuple[str, int, int], ...], ...] = ()

    def layer_linear_shapes(self, arch: ModelArch, layer: int) -> tuple[tuple[str, int, int], ...]:
        """nn.Linear (name, in, out) of decoder layer `layer`: what peft's "all-linear" adapts."""
        if self.layer_linears:
            return self.layer_linears[layer]
        if arch.is_moe and arch.dense_layer_mask >> layer & 1:
            return self.dense_linear_shapes
        return self.linear_shapes


def _layer_tensors(arch: ModelArch, shapes: dict[str, tuple[int, int]] | None = None) -> list[int]:
    """Numel of each parameter tensor of one decoder layer: linears, their biases, the norms.
    `shapes`: the layer's nn.Linear shapes (default `arch.linear_shapes()`)."""
    h, hd = arch.hidden_size, arch.head_dim
    q_out, kv_out = arch.num_attention_heads * hd, arch.num_kv_heads * hd
    tensors: list[int] = []
    for name, (fan_in, fan_out) in (arch.linear_shapes() if shapes is None else shapes).items():
        tensors.append(fan_in * fan_out)
        if arch.attention_bias and name in ("q_proj", "k_proj", "v_proj") and not arch.uses_mla:
            tensors.append(fan_out)
        if arch.attention_bias and name == "query_key_value":
            tensors.append(q_out + 2 * kv_out)
        if getattr(arch, "attention_out_bias", False) and name in ("o_proj", "dense"):
            tensors.append(h)
        if (
            arch.uses_mla
            and arch.attention_bias
            and name
            in (
                "q_a_proj",
                "kv_a_proj_with_mqa",
                "o_proj",
            )
        ):
            tensors.append(fan_out)  # DeepseekV3Attention: bias=config.attention_bias
        if getattr(arch, "mlp_bias", False) and name in (
            "gate_proj",
            "up_proj",
            "down_proj",
            "gate_up_proj",
        ):
            tensors.append(fan_out)
    if arch.uses_mla:  # DeepseekV3Attention q_a_layernorm, kv_a_layernorm (RMSNorm)
        tensors += [n for n in (arch.q_lora_rank, arch.kv_lora_rank) if n]
    tensors += [h] * getattr(arch, "norms_per_layer", 2)
    if arch.qk_norm:
        tensors += [hd, hd]
    return tensors


def _moe_layer_tensors(arch: ModelArch) -> list[int]:
    """An MoE decoder layer: its nn.Linear modules (attention, shared expert, Qwen2-MoE's
    shared_expert_gate) and norms, then the router weight (E, h) and the routed experts' two 3D
    parameters gate_up_proj (E, 2*I_e, h) and down_proj (E, h, I_e) (transformers >= 5
    modeling_mixtral.MixtralExperts/MixtralTopKRouter, Qwen2MoeExperts, Qwen3MoeExperts,
    DeepseekV3Experts)."""
    tensors = _layer_tensors(arch)
    fan_in, fan_out = arch.router_shape()
    tensors.append(fan_in * fan_out)
    tensors += [arch.num_experts * i * o for i, o in arch.expert_linear_shapes().values()]
    return tensors


@functools.lru_cache(maxsize=256)
def param_layout(arch: ModelArch) -> ParamLayout:
    """Parameter tensors of the HF implementation. Matches `ModelArch.num_params()`."""
    if arch.generic:
        return _inventory_layout(arch.inventory())
    embed = arch.vocab_size * arch.hidden_size
    lm_head = arch.hidden_size if arch.score_head else 0 if arch.tie_word_embeddings else embed
    if not arch.is_moe:
        tensors = _layer_tensors(arch)
        per_layer = sum(tensors)
        return ParamLayout(
            total=embed + arch.num_layers * per_layer + arch.hidden_size + lm_head,
            embed=embed,
            lm_head=lm_head,
            per_layer=per_layer,
            layer_tensors=tuple(tensors),
            linear_shapes=tuple((n, i, o) for n, (i, o) in arch.linear_shapes().items()),
            largest_module=max([embed, *tensors]),
        )
    moe = tuple(_moe_layer_tensors(arch))
    dense = tuple(_layer_tensors(arch, arch.dense_layer_linear_shapes()))
    dense_idx = set(arch.dense_layers)
    layers = tuple(dense if i in dense_idx else moe for i in range(arch.num_layers))
    # ZeRO-3 gathers a module's own parameters at once (DeepSpeed partition_parameters
    # `model_to_params`, recurse=False): the experts module is both 3D tensors, E * 3 * h * I_e.
    experts_module = arch.num_experts * arch.expert_params()
    return ParamLayout(
        total=embed + sum(sum(t) for t in layers) + arch.hidden_size + lm_head,
        embed=embed,
        lm_head=lm_head,
        per_layer=max(sum(t) for t in layers),
        layer_tensors=moe,
        linear_shapes=tuple((n, i, o) for n, (i, o) in arch.linear_shapes().items()),
        largest_module=max([embed, experts_module, *moe, *dense]),
        layers=layers,
        dense_linear_shapes=tuple((n, i, o) for n, (i, o) in arch.dense_layer_linear_shapes().items()),
        inactive=arch.num_params() - arch.num_active_params(),
    )


def _inventory_layout(inv) -> ParamLayout:
    """The layout of a model transformers built (memfit.estimate.models.inventory.Inventory)."""
    layers = tuple(tuple(n for m in inv.layer_modules(i) for n in m.numels) for i in range(inv.num_layers))
    # the leaf name peft matches target_modules against (q_proj, c_attn, experts.0.w1 -> w1)
    linears = tuple(
        tuple((m.name.rsplit(".", 1)[-1], *m.linear) for m in inv.layer_modules(i) if m.linear)
        for i in range(inv.num_layers)
    )
    top = max(range(inv.num_layers), key=lambda i: sum(layers[i]))
    return ParamLayout(
        total=inv.total,
        embed=inv.embed,
        lm_head=inv.lm_head,
        per_layer=sum(layers[top]),
        layer_tensors=layers[top],
        linear_shapes=linears[top],
        largest_module=max(sum(m.numels) for m in inv.modules),
        layers=layers if len(set(layers)) > 1 else (),
        inactive=inv.inactive,
        order=tuple(n for m in inv.modules for n in m.numels),
        units=tuple(
            tuple((sum(m.numels), m.linear is not None or _fused_experts(inv, m)) for m in inv.layer_modules(i))
            for i in range(inv.num_layers)
        ),
        layer_linears=linears,
    )


def _fused_experts(inv, m) -> bool:
    """Whether inventory module `m` is a routed-experts module with fused 3-D weights, which
    memfit's QLoRA stores in 4 bits (memfit.train.qlora_experts: the classes transformers
    decorates with `use_experts_implementation`)."""
    return m.expert and m.linear is None and _experts_class_is_fused(inv.class_name, m.cls)


@functools.lru_cache(maxsize=256)
def _experts_class_is_fused(model_class: str, cls: str) -> bool:
    import importlib

    import transformers

    model = getattr(transformers, model_class, None)
    experts = getattr(importlib.import_module(model.__module__), cls, None) if model is not None else None
    # use_experts_implementation gives the class `_apply_gate` (transformers integrations/moe.py)
    return experts is not None and hasattr(experts, "_apply_gate")


def fused_expert_matrices(arch: ModelArch) -> tuple[int, ...]:
    """Elements of one expert's matrix of each fused 3-D expert weight (gate_up_proj or up_proj,
    down_proj) of one MoE layer: what memfit's QLoRA quantizes per expert (4 bits, blocks of 64)
    and dequantizes per expert call. Empty for dense models and for experts kept as nn.Linear
    modules (bitsandbytes' Linear4bit quantizes those) or in classes memfit cannot run in 4 bits."""
    if not arch.is_moe:
        return ()
    if not arch.generic:
        return tuple(i * o for i, o in arch.expert_linear_shapes().values())
    inv = arch.inventory()
    E = max(1, inv.num_experts)
    for m in inv.modules:
        if _fused_experts(inv, m):
            # the weights, not their biases (gpt-oss): a bias is E * out, a weight E * out * in
            largest = max(m.numels)
            return tuple(n // E for n in m.numels if 16 * n >= largest)
    return ()


def fused_expert_weights(arch: ModelArch) -> int:
    """Elements of the routed experts' fused 3-D weights over every MoE layer (`fused_expert_matrices`)."""
    per_expert = sum(fused_expert_matrices(arch))
    if not per_expert:
        return 0
    E = arch.inventory().num_experts if arch.generic else arch.num_experts
    return len(arch.moe_layers()) * E * per_expert


def lora_targets(arch: ModelArch, settings: Settings, layer: int | None = None) -> tuple[tuple[str, int, int], ...]:
    """(name, in, out) of each adapted linear of one decoder layer (`layer`: which one, for MoE
    models whose dense layers hold other linears; default an MoE layer / any dense-model layer).

    MoE: the nn.Linear modules (attention, shared expert). The routed experts and the router
    are 3D / 2D nn.Parameters, adapted by peft's "all-linear" only for PEFT_ADAPTS_EXPERTS
    (`lora_adapts_experts`, counted by `expert_lora_params`)."""
    layout = param_layout(arch)
    shapes = layout.linear_shapes if layer is None else layout.layer_linear_shapes(arch, layer)
    if settings.lora_targets is None:
        return shapes  # peft target_modules="all-linear" (lm_head excluded)
    known = {n for n, _, _ in shapes} | {n for n, _, _ in layout.dense_linear_shapes}
    unknown = sorted(set(settings.lora_targets) - known)
    if unknown:
        raise EstimateError(
            f"unknown LoRA target(s) {unknown} for {arch.name}; linear layers: {[n for n, _, _ in shapes]}"
        )
    return tuple(s for s in shapes if s[0] in settings.lora_targets)


# model_types whose peft "all-linear" LoRA also adapts the routed experts and the router (peft
# >= 0.18 with transformers >= 5, peft/utils/transformers_weight_conversion.py
# `_convert_peft_config_moe`: the v4 nn.Linear names w1/w2/w3/gate_proj/up_proj/down_proj/gate
# are mapped onto the v5 3D parameters, as `target_parameters`). Qwen2-MoE has no entry in
# transformers' `_MODEL_TO_CONVERSION_PATTERN`, so peft leaves its experts alone (checked
# against the installed peft in tests/test_estimate_moe.py).
PEFT_ADAPTS_EXPERTS = ("mixtral", "qwen3_moe", "deepseek_v3")


def lora_adapts_experts(arch: ModelArch, settings: Settings, finetune: str = "lora") -> bool:
    """Whether LoRA with the default targets ("all-linear") puts adapters on the routed experts
    and the router of every MoE layer (see PEFT_ADAPTS_EXPERTS). Never under QLoRA of fused
    experts (`fused_expert_weights`): they are stored in 4 bits, and memfit's trainer leaves them
    and the router frozen (memfit.train.modeling.experts_left_frozen)."""
    if not (arch.is_moe and settings.lora_targets is None):
        return False
    if finetune == "qlora" and fused_expert_weights(arch):
        return False
    if arch.generic:  # what peft does on the model itself
        from memfit.estimate.models import layer_counts

        return layer_counts.lora_adapts_experts(arch.hf_config)
    return arch.model_type in PEFT_ADAPTS_EXPERTS


def expert_lora_params(arch: ModelArch, rank: int) -> int:
    """LoRA parameters peft's ParamWrapper adds to one MoE layer (peft/tuners/lora/layer.py
    ParamWrapper.update_layer: lora_A Linear(in, r*E), lora_B Linear(r*E, out) per 3D
    parameter): gate_up_proj at rank 2r (w1 and w3 fused: `rank_pattern` doubles it), down_proj
    at rank r, and the router weight (E, h) as one Linear of rank r."""
    h, E, inter = arch.hidden_size, arch.num_experts, arch.moe_intermediate_size
    return 2 * rank * E * (h + 2 * inter) + rank * E * (inter + h) + rank * (h + E)


def trainable_params(arch: ModelArch, cand: Candidate, settings: Settings) -> int:
    """Full: every parameter. LoRA/QLoRA: A (r x in) and B (out x r) per targeted linear
    (Hu et al. 2021, sec. 4; peft LoraLayer.update_layer)."""
    if cand.finetune == "full":
        if arch.generic:  # what the step gives a gradient (not a BART-style decoder's cross-attention)
            from memfit.estimate.models import layer_counts

            return param_layout(arch).total - layer_counts.ungraded_params(arch.hf_config)
        return param_layout(arch).total
    r = cand.lora_rank
    if arch.generic:  # what peft adds to the meta model, counted
        from memfit.estimate.models import layer_counts

        return layer_counts.lora_params(arch.hf_config, r, peft_targets(arch, cand, settings))
    # a reward model's score head trains in full beside the adapters (peft modules_to_save,
    # memfit.train.modeling): h parameters
    score = arch.hidden_size if arch.score_head else 0
    if arch.is_moe:
        experts = expert_lora_params(arch, r) if lora_adapts_experts(arch, settings, cand.finetune) else 0
        return (
            score
            + len(arch.moe_layers()) * experts
            + sum(r * (i + o) for layer in range(arch.num_layers) for _, i, o in lora_targets(arch, settings, layer))
        )
    return score + arch.num_layers * sum(r * (i + o) for _, i, o in lora_targets(arch, settings))


def peft_targets(arch: ModelArch, cand: Candidate, settings: Settings) -> tuple[str, ...] | None:
    """The LoRA targets peft is given. QLoRA of fused experts with targets peft maps onto them
    (`lora_adapts_experts` under plain LoRA): the linears peft's MoE conversion leaves in
    target_modules (peft/utils/transformers_weight_conversion.py `_MOE_TARGET_MODULE_MAPPING`
    names the v4 expert and router linears it moves to `target_parameters`), as memfit's trainer
    keeps them (memfit.train.modeling.experts_left_frozen)."""
    if not (cand.finetune == "qlora" and lora_adapts_experts(arch, settings)):
        return settings.lora_targets
    from peft.utils.transformers_weight_conversion import _MODEL_TO_CONVERSION_PATTERN, _MOE_TARGET_MODULE_MAPPING

    mapped = _MOE_TARGET_MODULE_MAPPING.get(_MODEL_TO_CONVERSION_PATTERN.get(arch.model_type, ""), {})
    names = {n for layer in param_layout(arch).layer_linears for n, _, _ in layer}
    return tuple(sorted(names - set(mapped)))
