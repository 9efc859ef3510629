"""How much of transformers memfit estimates, measured: for a model_type of transformers'
causal-LM mapping, a tiny random model of it (`tiny_config`: the type's own defaults, shrunk),
its estimate (parameters, peak) and one real CPU training step of it measured with memfit's
AllocationTracker (`measure_step_peak`), compared in `coverage_row`. benchmarks/bench_coverage.py
runs every type; tests/test_coverage.py a sample.

The measured step is the one memfit's estimator prices on `cpu` at ZeRO-0, fp32: the model as
transformers builds it, peft LoRA on every linear for `lora`, memfit's SFT loss
(memfit.train.losses.sft_loss), backward, torch AdamW (single-tensor) and a second step (the
optimizer states exist from the first); the peak is the largest live-bytes total on the CPU."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

# Imported with this module, not inside `measure_step_peak`: importing peft imports
# bitsandbytes, whose CPU backend logs a warning carrying the ImportError of its optional
# `kernels` package; that traceback keeps every frame of the stack alive as long as a log
# handler keeps the record (pytest's log capture does), and with them a measurement's models.
import peft  # noqa: F401

from memfit.estimate.models import inventory
from memfit.estimate.models.arch import ModelArch
from memfit.space import Candidate

# Size fields set to tiny values where a config has them (the shape: 2-4 layers, hidden
# 64-128, 4 experts where MoE, vocabulary 512); everything else keeps the type's default.
TINY_SIZES: dict[str, int] = {
    "hidden_size": 128,
    "n_embd": 128,
    "d_model": 128,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_heads": 4,
    "head_dim": 32,
    "intermediate_size": 256,
    "n_inner": 256,
    "ffn_hidden_size": 256,
    "moe_intermediate_size": 64,
    "expert_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_hidden_layers": 4,
    "n_layer": 4,
    "num_layers": 4,
    "vocab_size": 512,
    # mixture of experts
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "n_group": 1,
    "topk_group": 1,
    # multi-head latent attention
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    # linear attention (Gated DeltaNet, Qwen3-Next) and state-space layers (Mamba)
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "state_size": 16,
    "ssm_state_size": 16,
    "mamba_d_state": 16,
    "time_step_rank": 8,
    "mamba_dt_rank": 8,
    # other names for the same sizes (XLM, BART-style decoders, LongCat, Zamba, Gemma-3n ...)
    "emb_dim": 128,
    "n_layers": 4,
    "n_heads": 4,
    "decoder_layers": 4,
    "encoder_layers": 2,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_ffn_dim": 256,
    "encoder_ffn_dim": 256,
    "expert_ffn_hidden_size": 64,
    "shared_intermediate_size": 64,
    "attention_hidden_size": 256,
    "attention_head_dim": 64,
    "qk_head_dim": 32,
    "vocab_size_per_layer_input": 512,
    "hidden_size_per_layer_input": 32,
    "laurel_rank": 8,
}
TOP_K_MAX = 2  # experts per token in the tiny model


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str) -> dict[str, Any]:
    """The text model of `model_type` with transformers' defaults, shrunk (TINY_SIZES), as a
    config.json dict; key/value heads kept a divisor of the query heads."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    try:
        config = config.get_text_config()
    except ValueError:  # several text configs (MusicGen: text encoder and decoder): the decoder
        config = config.get_text_config(decoder=True)
    d = {k: v for k, v in config.to_dict().items() if not k.startswith("_")}
    layers = next((d[k] for k in ("num_hidden_layers", "n_layer", "num_layers") if isinstance(d.get(k), int)), 0)
    _shrink(d)
    heads = d.get("num_attention_heads", 4)
    kv = d.get("num_key_value_heads")
    if isinstance(kv, int) and isinstance(heads, int):
        d["num_key_value_heads"] = heads if kv >= heads else max(1, heads // 2)
    experts = any(isinstance(d.get(k), int) and d[k] > 1 for k in inventory.EXPERT_FIELDS)
    for key in inventory.TOP_K_FIELDS:
        if isinstance(d.get(key), int) and not isinstance(d.get(key), bool):
            d[key] = min(d[key], TOP_K_MAX)
        elif experts and key in d and d[key] is None:
            d[key] = TOP_K_MAX  # a default left unset (DeepSeek-V2's num_experts_per_tok)
    if isinstance(d.get("rotary_dim"), int):
        d["rotary_dim"] = 16  # partial rotary (CodeGen, GPT-J): within the shrunk head_dim
    for key, value in list(d.items()):  # per-layer lists follow the layer count
        if isinstance(value, list) and layers and len(value) == layers:
            d[key] = value[: TINY_SIZES["num_hidden_layers"]]
    _consistent(d, TINY_SIZES["num_hidden_layers"], TINY_SIZES["vocab_size"])
    d["model_type"] = str(config.model_type)
    return d


def _shrink(d: dict[str, Any]) -> None:
    """TINY_SIZES into `d` and its sub-configs (vision, audio, encoder ... dicts)."""
    for key, value in list(d.items()):
        if key in TINY_SIZES and isinstance(value, int) and not isinstance(value, bool):
            d[key] = TINY_SIZES[key]
        elif isinstance(value, dict) and "model_type" in value:
            _shrink(value)


def _consistent(d: dict[str, Any], layers: int, vocab: int) -> None:
    """What the shrunk sizes must still satisfy, as the config classes validate it."""
    hidden = d.get("hidden_size", 128)
    for key, value in list(d.items()):
        if key.endswith("_token_id") and isinstance(value, int) and value >= vocab:
            d[key] = min(2, vocab - 1)  # special tokens inside the vocabulary (padding_idx)
        if isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            d[key] = {k: v for k, v in value.items() if int(k) < layers}  # per-layer overrides
    if isinstance(d.get("mamba_d_ssm"), int):  # Falcon-H1: heads x head size = d_ssm
        d.update(mamba_n_heads=8, mamba_d_head=16, mamba_d_ssm=128)
    elif isinstance(d.get("mamba_expand"), int) and isinstance(d.get("mamba_d_head"), int) and "mamba_n_heads" in d:
        d["mamba_n_heads"] = d["mamba_expand"] * hidden // d["mamba_d_head"]  # Bamba/Granite hybrid
    if all(isinstance(d.get(k), int) for k in ("expand", "num_heads", "head_dim", "state_size")):
        d["num_heads"] = d["expand"] * hidden // d["head_dim"]  # Mamba-2: heads x head_dim = expand x hidden
        if isinstance(d.get("n_groups"), int):
            d["n_groups"] = 1
    if all(isinstance(d.get(k), int) for k in ("n_input_layers", "n_recurrent_layers", "n_output_layers")):
        d.update(n_input_layers=1, n_recurrent_layers=layers - 2, n_output_layers=1)
    if isinstance(d.get("d_head"), int) and isinstance(d.get("n_head"), int) and isinstance(d.get("d_model"), int):
        d["d_head"] = d["d_model"] // d["n_head"]  # XLNet
    if isinstance(d.get("axial_pos_embds_dim"), list):
        d["axial_pos_embds_dim"] = [hidden // 2, hidden - hidden // 2]  # Reformer: they sum to hidden
    if "is_decoder" in d:
        d["is_decoder"] = True  # Reformer's LM head needs it; BERT-like types are causal only so
    if d.get("causal") is False:
        d["causal"] = True  # XLM: a causal LM only with causal attention (config_fields.check_decoder)
    if isinstance(d.get("num_kv_shared_layers"), int):
        d["num_kv_shared_layers"] = 0  # Gemma-3n: the shared-KV tail needs more layers than 4


def measure_step_peak(arch: ModelArch, cand: Candidate, steps: int = 2) -> int:
    """Peak live CPU bytes of `steps` training steps of `arch` (random weights, fp32) as the
    estimator's cpu/ZeRO-0 setting prices them (module docstring)."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from memfit.train.lora import lora_config
    from memfit.train.losses import sft_loss
    from memfit.train.memory import AllocationTracker

    cfg = arch.to_hf_config()
    cfg.use_cache = False
    torch.manual_seed(0)
    attn = {"flash": "flash_attention_2"}.get(cand.attn, cand.attn)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn)
    if cand.finetune == "lora":
        model = get_peft_model(model, lora_config(model, cand.lora_rank))
    model.train()
    if cand.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cand.finetune == "lora":
            model.enable_input_require_grads()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=False)
    g = torch.Generator().manual_seed(1)
    with AllocationTracker() as tracker:
        for _ in range(steps):
            ids = torch.randint(0, arch.vocab_size, (cand.micro_batch, cand.seq_len), generator=g)
            out = model(input_ids=ids, use_cache=False)
            loss = sft_loss(out.logits, ids.clone())[0]
            del out
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
    return tracker.peak_bytes


@dataclasses.dataclass
class Row:
    """One model_type's line of the coverage table."""

    model_type: str
    finetune: str
    params_exact: bool | None = None  # the estimate's count == the real model's
    params: int = 0
    predicted: int = 0  # estimate's peak_allocated_bytes
    measured: int = 0  # AllocationTracker peak
    seconds: float = 0.0
    reason: str = ""  # why it was not estimated or not measured ("" when both ran)

    @property
    def error(self) -> float | None:
        return self.predicted / self.measured - 1 if self.measured and self.predicted else None

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "error": self.error}


def coverage_row(model_type: str, finetune: str = "full", trace_cache: str | None = None) -> Row:
    """Estimate and measure one training step of a tiny `model_type` (module docstring)."""
    import torch

    from memfit.estimate.core import estimate
    from memfit.estimate.models import catalog
    from memfit.estimate.settings import Settings

    row = Row(model_type, finetune)
    t0 = time.perf_counter()
    try:
        cfg = tiny_config(model_type)
        arch = catalog.arch_from_hf_config(cfg, name=f"tiny-{model_type}", where=f"tiny {model_type}")
        attn = "sdpa" if not arch.generic or "sdpa" in arch.inventory().attn else "eager"
        cand = Candidate(zero=0, precision="fp32", attn=attn, micro_batch=2, seq_len=64, finetune=finetune,
                         lora_rank=8, grad_ckpt=False, ref="precomputed")  # fmt: skip
        est = estimate(arch, catalog.gpu("cpu"), 1, 1, "sft", cand,
                       settings=Settings(optimizer_impl="single", zero0_engine="torch", padding_mask=False, activations="traced",
                                         trace_cache=trace_cache))  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the table reports why, whatever transformers raised
        row.reason = f"not estimated: {type(exc).__name__}: {_short(exc)}"
        row.seconds = time.perf_counter() - t0
        return row
    row.params, row.predicted = est.params_total, est.training_peak_bytes  # a measured step, no resume
    try:
        real = _real_count(arch)
        row.params_exact = real == est.params_total
        row.measured = measure_step_peak(arch, cand)
    except Exception as exc:  # noqa: BLE001 - the table reports whatever transformers raised
        row.reason = f"not measured: {type(exc).__name__}: {_short(exc)}"
    finally:
        torch.set_default_dtype(torch.float32)
    row.seconds = time.perf_counter() - t0
    return row


def _real_count(arch: ModelArch) -> int:
    """Parameters of the model transformers builds (real tensors on the meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(arch.to_hf_config())
    return sum(p.numel() for p in model.parameters())


def _short(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]


def rows_json(rows: list[Row]) -> str:
    return json.dumps([r.to_json() for r in rows], indent=1)
