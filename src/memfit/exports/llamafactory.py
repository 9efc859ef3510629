"""LLaMA-Factory: `llamafactory/train_<method>.yaml` + `llamafactory/ds_config.json` +
`llamafactory/dataset_info.json`, a `llamafactory-cli train` config (LLaMA-Factory 0.9.5,
`src/llamafactory/hparams/*.py`), the DeepSpeed JSON it points to, and the dataset registry
LLaMA-Factory reads from `dataset_dir` (the file must carry that name)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memfit.exports.common import (
    ExportPlan,
    SourceShape,
    hf_schedule,
    int_alpha,
    pref_values,
    sharegpt_tags,
    source_format,
    targets,
    tiled_mlp_missing,
)
from memfit.methods import shape

# LLaMA-Factory's stage for each method (hparams/finetuning_args.py `stage`); ORPO and SimPO are
# losses of its DPO stage (`pref_loss`: train/dpo/trainer.py odds_ratio_loss, simpo_loss)
STAGES = {"sft": "sft", "dpo": "dpo", "rm": "rm", "orpo": "dpo", "simpo": "dpo", "kto": "kto"}
NAMES = {"dpo": "DPO", "rm": "reward-model", "orpo": "ORPO", "simpo": "SimPO", "kto": "KTO"}


def llamafactory_config(plan: ExportPlan) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(train YAML as a dict, dataset_info.json, levers LLaMA-Factory 0.9.5 cannot express).

    The DeepSpeed JSON carries ZeRO, offload (pin_memory, ratio, parameters) and precision
    exactly; LLaMA-Factory passes it to the HF Trainer (`deepspeed:`)."""
    run, c = plan.run, plan.run.cand
    missing: list[str] = []
    name = f"memfit_{run.method}"
    y: dict[str, Any] = {
        "model_name_or_path": run.model_path,
        "stage": STAGES[run.method],
        "do_train": True,
        "finetuning_type": "full" if c.finetune == "full" else "lora",
    }
    if c.finetune != "full":
        target_list = targets(run)
        y |= {
            "lora_rank": c.lora_rank,
            "lora_alpha": int_alpha(plan, "LLaMA-Factory", missing),
            "lora_dropout": run.lora_dropout,
            "lora_target": "all" if target_list == ["all-linear"] else ",".join(target_list),
        }
        if c.finetune == "qlora":  # memfit.train.modeling: bitsandbytes nf4, double quantization
            y |= {
                "quantization_bit": 4,
                "quantization_method": "bnb",
                "quantization_type": "nf4",
                "double_quantization": True,
            }
    y["flash_attn"] = {"flash": "fa2", "sdpa": "sdpa", "eager": "disabled"}[c.attn]
    y["disable_gradient_checkpointing"] = not c.grad_ckpt  # LLaMA-Factory checkpoints unless told not to
    y["deepspeed"] = plan.file("llamafactory_ds")
    # data: the registry beside this file; no `template`: LLaMA-Factory then parses the tokenizer's
    # chat template (data/template.py get_template_and_fix_tokenizer), as memfit renders prompts
    y |= {
        "dataset": name,
        "dataset_dir": str(Path(plan.file("llamafactory_dataset_info")).parent),
        "cutoff_len": c.seq_len,
    }
    fmt = source_format(plan.data_source)
    missing.append(
        "truncation: LLaMA-Factory shortens prompt and response to fit cutoff_len (data/processor/"
        "processor_utils.py infer_seqlen); memfit never cuts a prompt (drops the row) and cuts responses only"
    )
    y |= _method_args(plan) if run.method in ("sft", "dpo") else _pref_args(plan, fmt, missing)
    if run.padding_free:
        missing.append(
            "padding_free: LLaMA-Factory pads every batch (its packing and neat_packing pack rows into "
            "sequences: memfit's `packing`, SFT only)"
        )
    y |= _reference_args(plan, missing)
    y |= _chat_args(plan, fmt, missing)
    y |= _long_context(c, missing)
    y |= hf_schedule(plan, missing)
    y |= {
        "per_device_train_batch_size": c.micro_batch,
        "gradient_accumulation_steps": c.grad_accum,
        "bf16": c.precision == "bf16",
        "fp16": c.precision == "fp16",
        "output_dir": f"{run.out_dir}_llamafactory",
        "report_to": "none",
    }
    if plan.eval_fraction:
        y |= {
            "val_size": plan.eval_fraction,
            "per_device_eval_batch_size": c.micro_batch,
            "eval_strategy": "steps",
            "eval_steps": run.eval_every,
        }
        missing.append(f"held-out split: val_size {plan.eval_fraction} draws random rows; memfit splits by prompt")
    if plan.world > 1 and plan.num_nodes > 1:
        missing.append(
            f"{plan.num_nodes} nodes: launch with FORCE_TORCHRUN=1 NNODES={plan.num_nodes} NODE_RANK=... "
            "MASTER_ADDR=... llamafactory-cli train (environment, not YAML)"
        )
    entry = _dataset_entry(plan, fmt)
    if not plan.data_source:
        missing.append("data: no data source in the config (plan only); set file_name in dataset_info.json")
    return y, {name: entry}, missing


def _long_context(c, missing: list[str]) -> dict[str, Any]:
    """The chunked loss and ALST's levers: what LLaMA-Factory has of them."""
    if c.loss_impl == "chunked":
        missing.append(
            "loss_impl chunked: no chunked-vocabulary loss option (closest: enable_liger_kernel, another kernel)"
        )
    if c.sequence_parallel > 1:
        missing.append(
            f"sequence_parallel {c.sequence_parallel}: no DeepSpeed Ulysses argument in LLaMA-Factory 0.9.5 (the "
            "DeepSpeed JSON's sequence_parallel_size alone does not split sequences)"
        )
    tiled_mlp_missing(c, "LLaMA-Factory", missing)
    if c.activation_offload:
        # model/model_utils/checkpointing.py get_unsloth_gradient_checkpointing_func: the checkpointed
        # hidden states go to the host ("Saves VRAM by smartly offloading to RAM"), blocking copies
        return {"use_unsloth_gc": True}
    return {}


def _method_args(plan: ExportPlan) -> dict[str, Any]:
    """SFT: prompt tokens in the loss, packing; DPO: beta, loss, label smoothing; both: Liger's kernels."""
    run = plan.run
    y: dict[str, Any] = {}
    if run.kernels == "liger":  # model_args.py: Liger's kernels for the model (RMSNorm, RoPE, SwiGLU, its loss)
        y["enable_liger_kernel"] = True
    if run.method == "sft":
        y["train_on_prompt"] = run.loss_on == "all"
        if run.packing:  # memfit packs without cross-row attention: neat_packing
            y |= {"packing": True, "neat_packing": True}
    else:
        dpo = run.dpo
        loss = dpo.get("loss_type", "sigmoid")
        y |= {
            "pref_beta": dpo.get("beta", 0.1),
            "pref_loss": loss,
            "dpo_label_smoothing": dpo.get("label_smoothing", 0.0),
        }
    return y


def _reference_args(plan: ExportPlan, missing: list[str]) -> dict[str, Any]:
    """DPO's and KTO's reference: a model path, the adapter-disabled model, or (not expressible) precomputed."""
    run, c = plan.run, plan.run.cand
    if not shape(run.method).reference:
        return {}
    if c.ref == "model":
        # a frozen copy; for LoRA without ref_model LLaMA-Factory would disable the adapter instead
        return {"ref_model": run.ref_model_path or run.model_path}
    if c.ref == "precomputed":
        missing.append(
            f"ref precomputed: LLaMA-Factory's {NAMES[run.method]} trainer turns TRL's precompute_ref_log_probs off; "
            "it holds a reference model (a copy for full fine-tuning)"
        )
    # ref adapter: LoRA without ref_model = the adapter-disabled model (train/trainer_utils.py create_ref_model)
    return {}


def _pref_args(plan: ExportPlan, fmt: SourceShape, missing: list[str]) -> dict[str, Any]:
    """rm, orpo, simpo, kto: their hyperparameters under LLaMA-Factory's names (hparams/finetuning_args.py
    RLHFArguments), what its trainers compute otherwise."""
    run = plan.run
    p = pref_values(run)
    if run.method == "rm":
        # train/rm/trainer.py compute_loss: -logsigmoid(r_chosen - r_rejected).mean(), nothing else
        if p["center_rewards_coefficient"] is not None:
            missing.append(
                f"center_rewards_coefficient {p['center_rewards_coefficient']}: LLaMA-Factory's reward loss has no "
                "centering term"
            )
        if fmt.margin:
            missing.append("margin: LLaMA-Factory's reward loss has no margin; the rows' `margin` is not used")
        missing.append(
            "reward head: LLaMA-Factory trains TRL's value head (AutoModelForCausalLMWithValueHead, saved as "
            "value_head.safetensors beside the model); memfit trains AutoModelForSequenceClassification's score "
            "head, the same one-output linear layer read at the last token, saved in the model"
        )
        return {}
    if run.method == "kto":
        missing.append(
            "KL batch: LLaMA-Factory pairs each row with the completion of the row before it in its preprocessing "
            "batch (data/processor/feedback.py); memfit pairs at prep time with the closest earlier row whose "
            "prompt differs, so the reference point z0 differs slightly"
        )
        return {
            "pref_beta": p["beta"],
            "kto_chosen_weight": p["desirable_weight"],
            "kto_rejected_weight": p["undesirable_weight"],
        }
    y: dict[str, Any] = {"pref_beta": p["beta"], "pref_loss": run.method}
    if run.method == "orpo":
        missing.append(
            "ORPO's NLL term: LLaMA-Factory scores each chosen response's tokens, averaged per pair; memfit (as "
            "TRL's ORPOTrainer) the chosen prompt and response tokens, averaged over the batch's tokens"
        )
        return y
    y["simpo_gamma"] = p["simpo_gamma"]
    if p["cpo_alpha"]:
        # train/dpo/trainer.py get_batch_loss_metrics: losses += pref_ftx * (-chosen length-averaged log-prob)
        y["pref_ftx"] = p["cpo_alpha"]
        missing.append(
            f"cpo_alpha {p['cpo_alpha']} as pref_ftx: LLaMA-Factory averages the chosen NLL per pair; memfit (as "
            "TRL's CPOTrainer) over the batch's chosen response tokens"
        )
    if p["label_smoothing"]:
        missing.append(
            f"label_smoothing {p['label_smoothing']}: LLaMA-Factory's SimPO loss has none (dpo_label_smoothing "
            "is for the sigmoid loss only)"
        )
    return y


def _chat_args(plan: ExportPlan, fmt: SourceShape, missing: list[str]) -> dict[str, Any]:
    """Chat rows: which assistant turns carry loss, what LLaMA-Factory reads of pairs and KTO rows."""
    method = plan.run.method
    if fmt.form == "chat" and method == "sft":
        # data/processor/supervised.py: mask_history keeps the labels of the last turn only
        return {"mask_history": plan.assistant_loss == "last"}
    if method == "kto":
        if plan.data_source and not fmt.unpaired:
            missing.append(
                "KTO from pairs: LLaMA-Factory's KTO stage reads unpaired rows with a kto_tag; convert each pair into "
                "a desirable and an undesirable row {prompt, completion, label} first (memfit's prepare_data does) "
                "and set file_name in dataset_info.json"
            )
        elif fmt.form == "chat_unpaired":
            missing.append(
                "conversational KTO rows (TRL's format): LLaMA-Factory's KTO rows are sharegpt `messages` with a "
                "kto_tag, or prompt/completion strings; convert the rows first"
            )
        return {}
    if fmt.form == "chat_pairs" and not (fmt.turn_objects and fmt.key == "conversations"):
        missing.append(
            f"conversational {NAMES[method]} pairs: LLaMA-Factory's sharegpt ranking rows (data/converter.py) take "
            "the prompt turns under `conversations` and chosen/rejected as one turn object each; TRL's turn lists"
            + (" and implicit prompts (no prompt column)" if fmt.key is None else "")
            + " must be converted to that first"
        )
    return {}


def _dataset_entry(plan: ExportPlan, fmt: SourceShape) -> dict[str, Any]:
    """The dataset_info.json entry: the data file, its columns (sharegpt tags for chat rows); pairs
    are `ranking` rows, KTO's unpaired rows carry their label as `kto_tag` (data/parser.py)."""
    run = plan.run
    data = shape(run.method).data
    file_name = str(Path(plan.data_source).resolve()) if plan.data_source else ""
    if data == "unpaired":
        # data/converter.py AlpacaDatasetConverter: the kto_tag's bool marks the response desirable
        columns = {"prompt": "prompt", "response": "completion", "kto_tag": "label"}
        return {"file_name": file_name if fmt.form == "prompt" and fmt.unpaired else "", "columns": columns}
    if fmt.form == "chat" and data == "sft":
        columns = {"messages": fmt.key}
    elif fmt.form == "chat_pairs" and data == "pairs":
        columns = {"messages": fmt.key or "chosen", "chosen": "chosen", "rejected": "rejected"}
    elif data == "sft":
        columns = {"prompt": "prompt", "response": "response"}
    else:
        columns = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}
    entry: dict[str, Any] = {"file_name": file_name, "columns": columns}
    if fmt.form != "prompt":
        entry |= {"formatting": "sharegpt", "tags": sharegpt_tags(fmt)}
    if data == "pairs":
        entry["ranking"] = True
    return entry
