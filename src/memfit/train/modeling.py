"""Loading the model a run trains (attention, dtype, checkpointing, LoRA/QLoRA), adapter-only
exports and merging LoRA into the base weights."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from memfit.atomic import replace_dir
from memfit.space import Candidate

ATTN_IMPL = {"flash": "flash_attention_2", "sdpa": "sdpa", "eager": "eager"}
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def attn_implementation(cand: Candidate) -> str:
    """transformers' `attn_implementation` for the candidate: ATTN_IMPL, except padding_free under
    sdpa, which runs memfit's per-sequence sdpa (memfit.train.varlen_attention: each sequence attends
    over itself, not over the row's T x T block-causal mask)."""
    if cand.padding_free and cand.attn == "sdpa":
        from memfit.train import varlen_attention

        return varlen_attention.register()
    return ATTN_IMPL[cand.attn]


def check_hardware(cand: Candidate) -> None:
    """Refuse what this machine cannot run, before loading anything."""
    if cand.attn == "flash":
        if not torch.cuda.is_available():
            raise RuntimeError("attn=flash needs a CUDA GPU (FlashAttention-2); use sdpa or eager on the CPU")
        major, _ = torch.cuda.get_device_capability()
        if major < 8:  # FlashAttention-2 README: Ampere, Ada or Hopper (sm80+)
            raise RuntimeError("attn=flash needs compute capability >= 8.0 (FlashAttention-2)")
        try:
            import flash_attn  # noqa: F401
        except ImportError as e:
            raise RuntimeError("attn=flash needs the flash-attn package (pip install '.[gpu]')") from e
    if cand.precision == "bf16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        raise RuntimeError("bf16 is not supported on this GPU (needs Ampere or newer); use fp16")
    if cand.finetune == "qlora":
        try:
            import bitsandbytes  # noqa: F401  (its CPU backend runs QLoRA without a GPU)
        except ImportError as e:
            raise RuntimeError(f"finetune=qlora needs bitsandbytes (pip install bitsandbytes): {e}") from e


ADAPTER_CONFIG = "adapter_config.json"  # what peft's save_pretrained writes beside the adapter weights


def adapter_base(path: str | Path) -> str | None:
    """The base model directory of an adapter-only export (`export: adapter`), from peft's
    adapter_config.json; None for a full model directory. memfit never downloads, so the base must
    be a local model directory (a relative path is read from the working directory)."""
    p = Path(path)
    if (p / "config.json").exists() or not (p / ADAPTER_CONFIG).exists():
        return None
    base = json.loads((p / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").exists():
        raise FileNotFoundError(
            f"{p / ADAPTER_CONFIG}: base_model_name_or_path {base!r} is not a local model directory "
            f"(no config.json; relative paths are read from {os.getcwd()}). An adapter-only export "
            "needs the base model it was trained on: restore it there, or export merged "
            "(train.<method>.export: merged)."
        )
    return base


def model_dir(path: str | Path) -> str:
    """Where a model's config.json lives: the base model's directory for an adapter-only export."""
    return adapter_base(path) or str(path)


def _merge_adapter(model, adapter_dir: str):
    """`model` with the adapter saved in `adapter_dir` merged into its weights (peft's own merge).
    Under ZeRO-3 (weights partitioned as they loaded) each adapted layer's weight is gathered,
    merged on rank 0 and partitioned again (DeepSpeed's GatheredParameters(modifier_rank=0))."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    peft_model = PeftModel.from_pretrained(model, adapter_dir)
    if not any(hasattr(p, "ds_id") for p in model.parameters()):
        return peft_model.merge_and_unload()
    import deepspeed

    from memfit.train import dist as dist_env

    for m in peft_model.modules():
        if isinstance(m, LoraLayer):
            with deepspeed.zero.GatheredParameters([m.get_base_layer().weight], modifier_rank=0):
                if dist_env.rank() == 0:
                    m.merge()
    return peft_model.unload()  # drops the (merged) adapter modules on every rank


def qlora_load_kwargs(cand: Candidate, quant_type: str = "nf4") -> dict[str, Any]:
    """`from_pretrained` keyword arguments that load the base model in 4 bits (QLoRA, Dettmers et
    al. 2023): NF4 (or FP4) blocks of 64 weights, double quantization (the absmax constants in 8
    bits), the matmuls in the training dtype. Only the decoder's nn.Linear layers are quantized
    (transformers' bitsandbytes integration keeps lm_head and the embeddings as they are).

    Where the weights go: on a GPU each rank loads onto its own device (`device_map` {"": local
    rank}, TRL's `get_kbit_device_map`); on the CPU onto the host (`device_map` "cpu": bitsandbytes'
    CPU backend quantizes and multiplies there). Under ZeRO-3 no device_map: transformers loads a
    quantized model without `deepspeed.zero.Init` (modeling_utils: `is_deepspeed_zero3_enabled()
    and not is_quantized`) and DeepSpeed partitions the packed weights when it wraps the model,
    which needs a storage dtype ZeRO-3 can shard: `bnb_4bit_quant_storage` = the training dtype
    (peft's "DeepSpeed ZeRO-3 + QLoRA" guide), otherwise the default uint8."""
    from transformers import BitsAndBytesConfig

    if quant_type not in ("nf4", "fp4"):
        raise ValueError(f"qlora_quant_type must be nf4 or fp4, got {quant_type!r}")
    out: dict[str, Any] = {
        "quantization_config": BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quant_type,
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=DTYPE[cand.precision],
            bnb_4bit_quant_storage=DTYPE[cand.precision] if cand.zero == 3 else torch.uint8,
        )
    }
    if cand.zero != 3:
        out["device_map"] = {"": int(os.environ.get("LOCAL_RANK", "0"))} if torch.cuda.is_available() else "cpu"
    return out


def _no_cpu_inference_repack(model) -> None:
    """Keep bitsandbytes' 4-bit weights in the layout they train in.

    On a CPU with AVX512-BF16, `bitsandbytes.nn.Linear4bit.forward` repacks a layer's weight into
    an inference layout the first time it runs in eval mode without grad
    (`_convert_weight_packed_for_cpu`; bitsandbytes 0.50.2 nn/modules.py), and from then on
    `matmul_4bit` multiplies through the bf16 `gemv_4bit` kernel, which autograd cannot
    differentiate, in training steps too. It also asserts out_features % 32 == 0, so a model with
    another width fails at its first evaluation. The repack is off on every machine, so an
    evaluation computes exactly what a training forward does (`gemm_4bit`, the compute dtype)."""
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False


def _quantize_experts(model, cand: Candidate, quant_type: str) -> list[str]:
    """QLoRA: the routed experts' fused 3-D weights in 4 bits as well (memfit.train.qlora_experts:
    bitsandbytes quantizes nn.Linear only), in the same format and storage dtype as the linears."""
    from memfit.train import qlora_experts

    storage = DTYPE[cand.precision] if cand.zero == 3 else torch.uint8
    return qlora_experts.quantize_fused_experts(model, quant_type, DTYPE[cand.precision], storage)


def experts_left_frozen(model, config):
    """`config` (peft's LoraConfig) with the 4-bit experts left frozen.

    peft >= 0.18 maps the transformers-v4 names of the expert linears (gate_proj, up_proj,
    down_proj; Mixtral's w1, w2, w3) and the router (gate) onto the v5 fused parameters as
    `target_parameters` (peft/utils/transformers_weight_conversion.py `_convert_peft_config_moe`,
    run by get_peft_model), and removes those names from `target_modules`. Its ParamWrapper
    adapts a floating-point parameter (W + BA), which the packed 4-bit experts are not, so QLoRA
    applies that conversion here and keeps only the `target_modules` it leaves: the experts and
    the router stay frozen, the linears named otherwise (attention, for "all-linear") train. A
    configuration with nothing left to adapt is refused, naming the targets."""
    from peft.utils.transformers_weight_conversion import (
        convert_peft_config_for_transformers,
        get_model_conversion_mapping,
    )

    config = copy.deepcopy(config)
    asked = config.target_modules
    convert_peft_config_for_transformers(config, model=model, conversions=get_model_conversion_mapping(model))
    dropped = sorted(config.target_parameters or ())
    config.target_parameters = None
    for pattern in (config.rank_pattern, config.alpha_pattern):
        for key in [k for k in pattern or {} if any(d.split(".")[0] in k for d in dropped)]:
            del pattern[key]
    if not config.target_modules:
        raise ValueError(
            f"QLoRA of {model.config.model_type}: the LoRA targets {asked!r} name only the routed experts "
            f"and the router ({', '.join(dropped)}), which stay frozen with the experts in 4 bits; "
            "name the linears to adapt in lora_targets (e.g. q_proj, k_proj, v_proj, o_proj)"
        )
    return config


def load_model(
    path: str,
    cand: Candidate,
    trainable: bool,
    lora: dict[str, Any] | None = None,
    quant_type: str = "nf4",
    score_pad_id: int | None = None,
):
    """A HF causal LM with the candidate's attention, dtype, checkpointing and adapters; with
    `score_pad_id` a reward model instead (memfit.train.preference.rm.build_reward_model: a
    one-output score head, trained beside LoRA adapters as peft's modules_to_save).

    `path` may be an adapter-only export (adapter_config.json, no config.json): the base model it
    names is loaded and the adapter merged in, so DPO can start from an SFT run that exported
    `adapter` exactly as from one that exported `merged`.
    """
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"attn_implementation": attn_implementation(cand), "dtype": DTYPE[cand.precision]}
    if cand.finetune == "qlora":
        # the DPO reference too (ref=model, precomputed): the same quantized base the policy's
        # adapter-disabled forward sees
        kwargs.update(qlora_load_kwargs(cand, quant_type))
    base = adapter_base(path)
    if score_pad_id is None:
        model = AutoModelForCausalLM.from_pretrained(base or path, **kwargs)
    else:
        from memfit.train.preference.rm import build_reward_model

        model = build_reward_model(base or path, score_pad_id, **kwargs)
    if base is not None:
        model = _merge_adapter(model, path)
        for p in model.parameters():  # peft froze the base weights; a full fine-tune trains them
            if p.is_floating_point():
                p.requires_grad_(True)
    model.config.use_cache = False
    expert_weights: list[str] = []
    if cand.finetune == "qlora":
        _no_cpu_inference_repack(model)
        expert_weights = _quantize_experts(model, cand, quant_type)
    if not trainable:
        model.eval()
        model.requires_grad_(False)
        return model
    if cand.finetune == "qlora":
        from peft import prepare_model_for_kbit_training

        # peft's k-bit preparation (peft/utils/other.py `prepare_model_for_kbit_training`):
        # freezes the base, upcasts its remaining 16-bit parameters (embeddings, norms, lm_head)
        # to fp32 "for stability", and enables checkpointing; non-reentrant checkpointing needs
        # no input that requires grad, so peft skips `enable_input_require_grads` for it.
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=cand.grad_ckpt,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    elif cand.grad_ckpt:
        # Non-reentrant checkpointing works with frozen inputs (LoRA) and ZeRO-3 hooks.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cand.finetune in ("lora", "qlora"):
        from peft import get_peft_model

        from memfit.train.lora import lora_config

        lora = lora or {}
        config = lora_config(model, cand.lora_rank, lora.get("alpha"), lora.get("dropout", 0.0), lora.get("targets"))
        if expert_weights:
            config = experts_left_frozen(model, config)
        if score_pad_id is not None:  # peft's SEQ_CLS task: the new score head trains in full beside the adapters
            config.task_type, config.modules_to_save = "SEQ_CLS", ["score"]
        model = get_peft_model(model, config)
        if cand.grad_ckpt and cand.finetune == "lora":
            model.enable_input_require_grads()
    return model


def _merged_lora_state(peft_model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The merged model's state dict from a PeftModel's consolidated (gathered) state dict:
    W + transpose(B @ A, fan_in_fan_out) * scaling per adapted linear layer, computed as peft's
    `lora.Linear.get_delta_weight` and `merge` do (fp32 for 16-bit weights, then W's dtype), and
    keys renamed to the base model's."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import transpose

    state = dict(state)
    for name, m in peft_model.named_modules():
        if not isinstance(m, LoraLayer):
            continue
        if not isinstance(m, LoraLinear) or any(m.use_dora.values()) or any(getattr(m, "lora_bias", {}).values()):
            raise ValueError(
                f"{name}: merging a {type(m).__name__} adapter from a ZeRO-3 state dict is not "
                "supported; use train.<method>.export: adapter"
            )
        for adapter in list(m.lora_A):
            a = state.pop(f"{name}.lora_A.{adapter}.weight")
            b = state.pop(f"{name}.lora_B.{adapter}.weight")
            w = f"{name}.base_layer.weight"
            fp32 = b.dtype in (torch.float16, torch.bfloat16)
            delta = (
                transpose((b.float() if fp32 else b) @ (a.float() if fp32 else a), m.fan_in_fan_out)
                * m.scaling[adapter]
            )
            state[w] = state[w] + delta.to(b.dtype)
    prefix = "base_model.model."
    return {k.removeprefix(prefix).replace(".base_layer.", "."): v for k, v in state.items()}


def hidden_size(model_path: str) -> int | None:
    """The model's hidden size from config.json (text_config for multimodal configs)."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    return cfg.get("hidden_size") or cfg.get("text_config", {}).get("hidden_size")


def export_model(engine, tokenizer, out: Path, cand: Candidate, rank: int, fmt: str, model_path: str = "") -> None:
    """Final model in HF format (safetensors) in `out`/model, written to model.tmp and renamed
    into place: `fmt` merged (LoRA merged into the base) or adapter. ZeRO-3 gathers the
    partitioned weights first; every rank calls this (collectives). QLoRA merges its adapter into
    the base loaded unquantized from `model_path` (`_qlora_merged`)."""
    if fmt == "adapter" or cand.finetune == "qlora":
        state = _adapter_state(engine, cand, rank)
        if fmt == "adapter":
            _write_export(out, rank, tokenizer, lambda tmp: _save_adapter(engine.module, state, tmp))
        else:
            _write_export(out, rank, tokenizer, lambda tmp: _qlora_merged(engine.module, state, cand, model_path, tmp))
        return
    module = engine.module
    # collective: every rank calls
    state = engine._zero3_consolidated_16bit_state_dict() if cand.zero == 3 else None

    def write(tmp: Path) -> None:
        if cand.finetune == "lora" and state is not None:
            # ZeRO-3: the module's weights are partitioned (shape [0]) and cannot take the
            # consolidated state; merge in the gathered state dict instead.
            module.get_base_model().save_pretrained(
                tmp, state_dict=_merged_lora_state(module, state), safe_serialization=True
            )
        elif cand.finetune == "lora":
            module.merge_and_unload().save_pretrained(tmp, safe_serialization=True)
        else:
            module.save_pretrained(tmp, state_dict=state, safe_serialization=True)

    _write_export(out, rank, tokenizer, write)


def _write_export(out: Path, rank: int, tokenizer, write) -> None:
    """Rank 0 writes (`write(tmp)`) the model and the tokenizer to out/model.tmp and renames it to
    out/model; every rank waits for it."""
    from memfit.train import dist as dist_env

    if rank == 0:
        tmp = out / "model.tmp"
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp)
        write(tmp)
        tokenizer.save_pretrained(tmp)
        replace_dir(tmp, out / "model")
    dist_env.barrier()


def _adapter_state(engine, cand: Candidate, rank: int) -> dict[str, torch.Tensor] | None:
    """The trainable (adapter) weights on rank 0, None elsewhere. Only those are gathered under
    ZeRO-3: GatheredParameters over them, not the whole model that
    _zero3_consolidated_16bit_state_dict would collect (a collective: every rank calls)."""
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    if cand.zero == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
            return {n: p.detach().cpu().clone() for n, p in named} if rank == 0 else None
    return {n: p.detach().cpu().clone() for n, p in named} if rank == 0 else None


def _save_adapter(peft_model, state: dict[str, torch.Tensor], tmp: Path) -> None:
    """LoRA/QLoRA adapter only: peft's adapter_model.safetensors + adapter_config.json."""
    peft_model.save_pretrained(tmp, state_dict=state, safe_serialization=True, save_embedding_layers=False)


def _qlora_merged(peft_model, state: dict[str, torch.Tensor], cand: Candidate, model_path: str, tmp: Path) -> None:
    """QLoRA's merged export: the adapter merged into the base model loaded unquantized in the
    training dtype (as the QLoRA paper's released models and peft's merging guide do), not into
    the 4-bit weights, whose re-quantization after the merge would add a second rounding error.
    Rank 0 holds that whole model in host memory for the merge; export `adapter` avoids it."""
    from peft import get_peft_model

    base = load_model(model_path, dataclasses.replace(cand, finetune="full", ref="precomputed"), trainable=False)
    merged = get_peft_model(base, copy.deepcopy(peft_model.peft_config["default"]))
    result = merged.load_state_dict(state, strict=False)
    if result.unexpected_keys or set(state) - {n for n, _ in merged.named_parameters()}:
        raise RuntimeError(f"QLoRA merge: adapter keys not in the unquantized model: {result.unexpected_keys[:5]}")
    merged.merge_and_unload().save_pretrained(tmp, safe_serialization=True)
