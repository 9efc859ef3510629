"""HF: `hf/training_args.json` + `hf/ds_config.json`, `transformers.TrainingArguments` keyword
arguments (`HfArgumentParser(TrainingArguments).parse_dict`) and their DeepSpeed JSON. The
`_memfit` key is not an argument: it holds the fields of the method's TRL config (`TRL_CLASSES`:
SFTConfig, DPOConfig, RewardConfig, ORPOConfig, CPOConfig for SimPO, KTOConfig: max length,
packing, the method's hyperparameters, the reference) and peft's `LoraConfig`, which
TrainingArguments has no field for, the levers no field expresses (`not_expressible`) and what the
trainer does as memfit does without a field for it (`notes`)."""

from __future__ import annotations

from typing import Any

from memfit.exports.common import ExportPlan, hf_schedule, pref_values, source_format, tiled_mlp_missing
from memfit.methods import shape


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
    notes: list[str] = []
    trl = _trl_fields(plan, dtype, attn, missing, notes)
    peft = _peft_config(plan, dtype, trl)
    # TrainingArguments: Liger's kernels. TRL 1.16 applies them to the model (its DPOTrainer only the layer
    # kernels, its loss through its own fused LM head) and warns the flag is deprecated for Hub kernels
    if run.kernels == "liger":
        args["use_liger_kernel"] = True
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
        "trl_class": TRL_CLASSES[run.method],
        "trl_fields": trl,
        "notes": notes,
        "peft_lora_config": peft,
        "parallelism_config": parallelism,
        "not_expressible": missing,
    }
    return args, missing


def _peft_config(plan: ExportPlan, dtype: str, trl: dict[str, Any]) -> dict[str, Any] | None:
    """peft's LoraConfig fields (None: full fine-tuning); QLoRA's quantization goes into `trl`'s model_init_kwargs."""
    run, c = plan.run, plan.run.cand
    if c.finetune == "full":
        return None
    peft: dict[str, Any] = {
        "r": c.lora_rank,
        "lora_alpha": plan.lora_alpha,
        "lora_dropout": run.lora_dropout,
        "target_modules": run.lora_targets,
        "task_type": "CAUSAL_LM",
    }
    if shape(run.method).head == "score":
        # memfit.train.modeling: peft's SEQ_CLS task, the new score head trained in full beside the
        # adapters (TRL's RewardTrainer docs recommend modules_to_save=["score"] too)
        peft |= {"task_type": "SEQ_CLS", "modules_to_save": ["score"]}
    if c.finetune == "qlora":
        trl["model_init_kwargs"]["quantization_config"] = {
            "load_in_4bit": True,
            "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": dtype,
            "bnb_4bit_quant_storage": dtype,
        }
    return peft


# The TRL 1.16 config class each method's trainer takes (ORPO's and CPO's live under trl.experimental
# there: trl/experimental/orpo/orpo_config.py, trl/experimental/cpo/cpo_config.py)
TRL_CLASSES = {
    "sft": "trl.SFTConfig",
    "dpo": "trl.DPOConfig",
    "rm": "trl.RewardConfig",
    "orpo": "trl.experimental.orpo.ORPOConfig",
    "simpo": "trl.experimental.cpo.CPOConfig",
    "kto": "trl.KTOConfig",
}
TRL_TRAINERS = {m: c.rsplit(".", 1)[1].replace("Config", "Trainer") for m, c in TRL_CLASSES.items()}


def _trl_fields(plan: ExportPlan, dtype: str, attn: str, missing: list[str], notes: list[str]) -> dict[str, Any]:
    """The fields of the method's TRL config (`TRL_CLASSES`) as memfit's run sets them."""
    run, c = plan.run, plan.run.cand
    trl: dict[str, Any] = {
        "max_length": c.seq_len,
        "model_init_kwargs": {"attn_implementation": attn, "dtype": dtype},
    }
    if run.method == "sft":
        trl |= _trl_sft_loss(plan, missing)
        trl["packing"] = run.packing
        if run.packing:
            trl["packing_strategy"] = "bfd"  # memfit.data.pack: best-fit decreasing, TRL's default
        trl["padding_free"] = run.padding_free  # SFTConfig: one row per batch, positions restarting per row
    elif run.method == "dpo":
        dpo = run.dpo
        trl |= {
            "beta": dpo.get("beta", 0.1),
            "loss_type": [dpo.get("loss_type", "sigmoid")],
            "label_smoothing": dpo.get("label_smoothing", 0.0),
            "precompute_ref_log_probs": c.ref == "precomputed",
            "padding_free": run.padding_free,  # DPOConfig: the batch's sequences as one row
        }
    else:
        trl |= _trl_pref_fields(plan, missing, notes)
    if run.method in ("orpo", "simpo"):
        # ORPOTrainer and CPOTrainer load the model with device_map "auto" unless told otherwise
        # (trl/experimental/orpo/orpo_trainer.py, cpo/cpo_trainer.py __init__), which spreads it over
        # every visible GPU; under DeepSpeed each rank loads it whole, as memfit does
        trl["model_init_kwargs"]["device_map"] = None
    trainer = TRL_TRAINERS[run.method]
    if run.padding_free and run.method not in ("sft", "dpo"):  # TRL 1.16: only SFTConfig and DPOConfig have it
        missing.append(
            f"padding_free: {TRL_CLASSES[run.method].rsplit('.', 1)[1]} has no padding_free; {trainer} pads every batch"
        )
    if shape(run.method).data == "pairs" and source_format(plan.data_source).turn_objects:
        missing.append(
            f"chosen/rejected as single turn objects (LLaMA-Factory's ranking rows): {trainer} takes TRL's "
            "conversational pairs, turn lists; convert the rows first"
        )
    if shape(run.method).reference and c.ref == "model" and c.finetune != "full":
        missing.append(
            f"ref model with LoRA: pass {trainer}(ref_model=<a frozen copy>); without one TRL "
            "disables the adapter (memfit's ref adapter)"
        )
    return trl


def _trl_pref_fields(plan: ExportPlan, missing: list[str], notes: list[str]) -> dict[str, Any]:
    """RewardConfig, ORPOConfig, CPOConfig (SimPO) or KTOConfig fields from the run's hyperparameters."""
    run, c = plan.run, plan.run.cand
    p = pref_values(run)
    fmt = source_format(plan.data_source)
    if run.method == "rm":
        if fmt.margin:  # trl/trainer/reward_trainer.py DataCollatorForPreference: the `margin` key
            notes.append(
                "margin: the rows carry a `margin`; RewardTrainer subtracts it inside the sigmoid as memfit does "
                "(no config field: its collator reads the dataset's margin column)"
            )
        return {"center_rewards_coefficient": p["center_rewards_coefficient"]}
    if run.method == "kto":
        if not fmt.unpaired and plan.data_source:
            notes.append(
                "pairs: KTOTrainer unpairs them itself (unpair_preference_dataset), as memfit's prepare_data does"
            )
        missing.append(
            "KL batch: KTOTrainer pairs each row with the completion of the row before it within blocks of "
            "per_device_train_batch_size dataset rows (add_kl_completion_ids); memfit pairs at prep time with the "
            "closest earlier row whose prompt differs, so the reference point z0 differs slightly"
        )
        return {
            "loss_type": "kto",  # memfit.train.preference.kto: Ethayarajh et al. 2024's loss, TRL's "kto"
            "beta": p["beta"],
            "desirable_weight": p["desirable_weight"],
            "undesirable_weight": p["undesirable_weight"],
            "precompute_ref_log_probs": c.ref == "precomputed",
        }
    fields: dict[str, Any] = {"beta": p["beta"]}
    if run.method == "simpo":  # Meng et al. 2024 through CPOTrainer (its docs: loss_type="simpo", cpo_alpha=0)
        fields |= {
            "loss_type": "simpo",
            "simpo_gamma": p["simpo_gamma"],
            "cpo_alpha": p["cpo_alpha"],
            "label_smoothing": p["label_smoothing"],
        }
    return fields


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
