"""HF: `hf/training_args.json` + `hf/ds_config.json`, `transformers.TrainingArguments` keyword
arguments (`HfArgumentParser(TrainingArguments).parse_dict`) and their DeepSpeed JSON. The
`_memfit` key is not an argument: it holds the TRL `SFTConfig`/`DPOConfig` fields (max length,
packing, DPO beta/loss, reference) and peft's `LoraConfig`, which TrainingArguments has no field
for, and the levers no field expresses."""

from __future__ import annotations

from typing import Any

from memfit.exports.common import ExportPlan, hf_schedule, source_format, tiled_mlp_missing


def hf_training_args(plan: ExportPlan) -> tuple[dict[str, Any], list[str]]:
    """(TrainingArguments keyword arguments + `_memfit`, levers they cannot express)."""
    import transformers

    run, c = plan.run, plan.run.cand
    missing: list[str] = []
    args: dict[str, Any] = {
        "output_dir": f"{run.out_dir}_hf",
        "per_device_train_batch_size": c.micro_batch,
        "gradient_accumulation_steps": c.grad_accum,
        "gradient_checkpointing": c.grad_ckpt,
        "bf16": c.precision == "bf16",
        "fp16": c.precision == "fp16",
        "deepspeed": plan.file("hf_ds"),
        "report_to": "none",
        **hf_schedule(plan, missing),
    }
    if plan.eval_fraction:
        args |= {
            "eval_strategy": "steps",
            "eval_steps": run.eval_every,
            "per_device_eval_batch_size": c.micro_batch,
        }
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[c.precision]
    attn = {"flash": "flash_attention_2", "sdpa": "sdpa", "eager": "eager"}[c.attn]
    trl_class, trl = _trl_fields(plan, dtype, attn, missing)
    peft = None
    if c.finetune != "full":
        peft = {
            "r": c.lora_rank,
            "lora_alpha": plan.lora_alpha,
            "lora_dropout": run.lora_dropout,
            "target_modules": run.lora_targets,
            "task_type": "CAUSAL_LM",
        }
        if c.finetune == "qlora":
            trl["model_init_kwargs"]["quantization_config"] = {
                "load_in_4bit": True,
                "bnb_4bit_quant_type": "nf4",
                "bnb_4bit_use_double_quant": True,
                "bnb_4bit_compute_dtype": dtype,
                "bnb_4bit_quant_storage": dtype,
            }
    if c.loss_impl == "chunked":
        missing.append(
            "loss_impl chunked: TrainingArguments/TRL have no chunked-vocabulary loss (closest: "
            "use_liger_kernel, another kernel)"
        )
    parallelism = None
    if c.sequence_parallel > 1:
        # accelerate's ParallelismConfig (sp_backend "deepspeed": ALST/Ulysses), a TrainingArguments
        # field that takes an object, not JSON (accelerate/parallelism_config.py, 1.15 here)
        parallelism = {"sp_size": c.sequence_parallel, "sp_backend": "deepspeed"}
        missing.append(
            f"sequence_parallel {c.sequence_parallel}: pass TrainingArguments(parallelism_config="
            f"accelerate.ParallelismConfig(**_memfit['parallelism_config'])); not a JSON field"
        )
    if c.activation_offload:  # TRL's own offload (trl/models/activation_offloading.py)
        trl["activation_offloading"] = True
        missing.append(
            "activation_offload: trl activation_offloading=true set; TRL moves every saved activation to the "
            "host, not only the checkpointed layer inputs DeepSpeed's does (more host traffic)"
        )
    tiled_mlp_missing(c, "TrainingArguments/TRL", missing)
    if plan.eval_fraction:
        missing.append(f"held-out split (eval_fraction {plan.eval_fraction}, by prompt): pass your own eval_dataset")
    args["_memfit"] = {
        "about": "not a TrainingArguments field: drop this key before TrainingArguments(**args) / "
        "HfArgumentParser(TrainingArguments).parse_dict(args)",
        "written_with": {"transformers": transformers.__version__},
        "candidate": c.id,
        "trl_class": trl_class,
        "trl_fields": trl,
        "peft_lora_config": peft,
        "parallelism_config": parallelism,
        "not_expressible": missing,
    }
    return args, missing


def _trl_fields(plan: ExportPlan, dtype: str, attn: str, missing: list[str]) -> tuple[str, dict[str, Any]]:
    """(TRL config class, its fields): `SFTConfig` or `DPOConfig` as memfit's run sets them."""
    run, c = plan.run, plan.run.cand
    trl: dict[str, Any] = {
        "max_length": c.seq_len,
        "model_init_kwargs": {"attn_implementation": attn, "dtype": dtype},
    }
    if run.method == "sft":
        trl_class = "trl.SFTConfig"
        trl |= _trl_sft_loss(plan, missing)
        trl["packing"] = run.packing
        if run.packing:
            trl["packing_strategy"] = "bfd"  # memfit.data.pack: best-fit decreasing, TRL's default
    else:
        trl_class = "trl.DPOConfig"
        dpo = run.dpo
        trl |= {
            "beta": dpo.get("beta", 0.1),
            "loss_type": [dpo.get("loss_type", "sigmoid")],
            "label_smoothing": dpo.get("label_smoothing", 0.0),
            "precompute_ref_log_probs": c.ref == "precomputed",
        }
        if source_format(plan.data_source).turn_objects:
            missing.append(
                "chosen/rejected as single turn objects (LLaMA-Factory's ranking rows): DPOTrainer takes TRL's "
                "conversational pairs, turn lists; convert the rows first"
            )
        if c.ref == "model" and c.finetune != "full":
            missing.append(
                "ref model with LoRA: pass DPOTrainer(ref_model=<a frozen copy>); without one TRL "
                "disables the adapter (memfit's ref adapter)"
            )
    return trl_class, trl


def _trl_sft_loss(plan: ExportPlan, missing: list[str]) -> dict[str, Any]:
    """What SFTConfig scores: the completion of prompt/response rows, the assistant turns of chat
    rows (SFTTrainer converts ShareGPT `conversations` to `messages` itself: maybe_convert_to_chatml)."""
    response_only = plan.run.loss_on == "response"
    if source_format(plan.data_source).form != "chat":
        return {"completion_only_loss": response_only}
    if response_only:
        # TRL masks by the chat template's {% generation %} blocks (return_assistant_tokens_mask)
        missing.append(
            "assistant_only_loss needs a chat template with {% generation %} markers; TRL refuses a template "
            "without them (memfit finds the assistant turns by rendering prefixes)"
        )
        if plan.assistant_loss == "last":
            missing.append(
                "assistant_loss last: assistant_only_loss scores every assistant turn; memfit scores the last one only"
            )
    return {"assistant_only_loss": response_only}
