"""Loading the model a run trains (attention, dtype, checkpointing, LoRA/QLoRA), adapter-only
exports and merging LoRA into the base weights."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from memfit.atomic import replace_dir
from memfit.space import Candidate

ATTN_IMPL = {"flash": "flash_attention_2", "sdpa": "sdpa", "eager": "eager"}
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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
    if cand.finetune == "qlora" and not torch.cuda.is_available():
        raise RuntimeError("finetune=qlora needs bitsandbytes on a CUDA GPU; it cannot run on the CPU")


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
    import torch.distributed as dist

    for m in peft_model.modules():
        if isinstance(m, LoraLayer):
            with deepspeed.zero.GatheredParameters([m.get_base_layer().weight], modifier_rank=0):
                if dist.get_rank() == 0:
                    m.merge()
    return peft_model.unload()  # drops the (merged) adapter modules on every rank


def load_model(path: str, cand: Candidate, trainable: bool, lora: dict[str, Any] | None = None):
    """A HF causal LM with the candidate's attention, dtype, checkpointing and adapters.

    `path` may be an adapter-only export (adapter_config.json, no config.json): the base model it
    names is loaded and the adapter merged in, so DPO can start from an SFT run that exported
    `adapter` exactly as from one that exported `merged`.
    """
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"attn_implementation": ATTN_IMPL[cand.attn], "dtype": DTYPE[cand.precision]}
    if cand.finetune == "qlora" and trainable:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=DTYPE[cand.precision],
            # peft's ZeRO-3 + QLoRA recipe: a storage dtype ZeRO-3 can shard.
            bnb_4bit_quant_storage=DTYPE[cand.precision],
        )
    base = adapter_base(path)
    model = AutoModelForCausalLM.from_pretrained(base or path, **kwargs)
    if base is not None:
        model = _merge_adapter(model, path)
        for p in model.parameters():  # peft froze the base weights; a full fine-tune trains them
            if p.is_floating_point():
                p.requires_grad_(True)
    model.config.use_cache = False
    if not trainable:
        model.eval()
        model.requires_grad_(False)
        return model
    if cand.grad_ckpt:
        # Non-reentrant checkpointing works with frozen inputs (LoRA) and ZeRO-3 hooks.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cand.finetune in ("lora", "qlora"):
        from peft import LoraConfig, get_peft_model

        lora = lora or {}
        model = get_peft_model(
            model,
            LoraConfig(
                r=cand.lora_rank,
                lora_alpha=lora.get("alpha") or 2 * cand.lora_rank,
                lora_dropout=lora.get("dropout", 0.0),
                target_modules=lora.get("targets", "all-linear"),
                task_type="CAUSAL_LM",
            ),
        )
        if cand.grad_ckpt:
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


def export_model(engine, tokenizer, out: Path, cand: Candidate, rank: int, fmt: str) -> None:
    """Final model in HF format (safetensors) in `out`/model, written to model.tmp and renamed
    into place: `fmt` merged (LoRA merged into the base) or adapter. ZeRO-3 gathers the
    partitioned weights first; every rank calls this (collectives)."""
    if fmt == "adapter":
        _export_adapter(engine, tokenizer, out, cand, rank)
        return
    import torch.distributed as dist

    dest = out / "model"
    module = engine.module
    if cand.zero == 3:
        state = engine._zero3_consolidated_16bit_state_dict()  # collective: every rank calls
    else:
        state = None
    if rank == 0:
        tmp = out / "model.tmp"
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp)
        if cand.finetune in ("lora", "qlora") and state is not None:
            # ZeRO-3: the module's weights are partitioned (shape [0]) and cannot take the
            # consolidated state; merge in the gathered state dict instead.
            module.get_base_model().save_pretrained(
                tmp, state_dict=_merged_lora_state(module, state), safe_serialization=True
            )
        elif cand.finetune in ("lora", "qlora"):
            merged = module.merge_and_unload()
            merged.save_pretrained(tmp, safe_serialization=True)
        else:
            module.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        replace_dir(tmp, dest)
    if dist.is_initialized():
        dist.barrier()


def _export_adapter(engine, tokenizer, out: Path, cand: Candidate, rank: int) -> None:
    """LoRA/QLoRA adapter only: peft's adapter_model.safetensors + adapter_config.json (+ the
    tokenizer) in out_dir/model, written to model.tmp and renamed into place. Only the
    trainable (adapter) weights are gathered under ZeRO-3: GatheredParameters over those, not
    the whole model that _zero3_consolidated_16bit_state_dict would collect."""
    import torch.distributed as dist

    module = engine.module
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if cand.zero == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):  # collective
            state = {n: p.detach().cpu().clone() for n, p in named} if rank == 0 else None
    else:
        state = {n: p.detach().cpu().clone() for n, p in named} if rank == 0 else None
    if rank == 0:
        tmp = out / "model.tmp"
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp)
        module.save_pretrained(tmp, state_dict=state, safe_serialization=True, save_embedding_layers=False)
        tokenizer.save_pretrained(tmp)
        replace_dir(tmp, out / "model")
    if dist.is_initialized():
        dist.barrier()
