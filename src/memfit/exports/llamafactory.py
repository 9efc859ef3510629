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
    sharegpt_tags,
    source_format,
    targets,
    tiled_mlp_missing,
)


def llamafactory_config(plan: ExportPlan) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(train YAML as a dict, dataset_info.json, levers LLaMA-Factory 0.9.5 cannot express).

    The DeepSpeed JSON carries ZeRO, offload (pin_memory, ratio, parameters) and precision
    exactly; LLaMA-Factory passes it to the HF Trainer (`deepspeed:`)."""
    run, c = plan.run, plan.run.cand
    missing: list[str] = []
    name = f"memfit_{run.method}"
    y: dict[str, Any] = {
        "model_name_or_path": run.model_path,
        "stage": run.method,
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
    y |= _method_args(plan, missing)
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


def _method_args(plan: ExportPlan, missing: list[str]) -> dict[str, Any]:
    """SFT: prompt tokens in the loss, packing; DPO: beta, loss, label smoothing, the reference."""
    run, c = plan.run, plan.run.cand
    y: dict[str, Any] = {}
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
        if c.ref == "model":
            # a frozen copy; for LoRA without ref_model LLaMA-Factory would disable the adapter instead
            y["ref_model"] = run.ref_model_path or run.model_path
        elif c.ref == "precomputed":
            missing.append(
                "ref precomputed: LLaMA-Factory's DPO trainer turns TRL's precompute_ref_log_probs off; "
                "it holds a reference model (a copy for full fine-tuning)"
            )
        # ref adapter: LoRA without ref_model = the adapter-disabled model (train/trainer_utils.py create_ref_model)
    return y


def _chat_args(plan: ExportPlan, fmt: SourceShape, missing: list[str]) -> dict[str, Any]:
    """Chat rows: which assistant turns carry loss, what LLaMA-Factory reads of DPO pairs."""
    if fmt.form == "chat" and plan.run.method == "sft":
        # data/processor/supervised.py: mask_history keeps the labels of the last turn only
        return {"mask_history": plan.assistant_loss == "last"}
    if fmt.form == "chat_pairs" and not (fmt.turn_objects and fmt.key == "conversations"):
        missing.append(
            "conversational DPO pairs: LLaMA-Factory's sharegpt ranking rows (data/converter.py) take the prompt "
            "turns under `conversations` and chosen/rejected as one turn object each; TRL's turn lists"
            + (" and implicit prompts (no prompt column)" if fmt.key is None else "")
            + " must be converted to that first"
        )
    return {}


def _dataset_entry(plan: ExportPlan, fmt: SourceShape) -> dict[str, Any]:
    """The dataset_info.json entry: the data file, its columns (sharegpt tags for chat rows)."""
    run = plan.run
    if fmt.form == "chat" and run.method == "sft":
        columns = {"messages": fmt.key}
    elif fmt.form == "chat_pairs" and run.method == "dpo":
        columns = {"messages": fmt.key or "chosen", "chosen": "chosen", "rejected": "rejected"}
    elif run.method == "sft":
        columns = {"prompt": "prompt", "response": "response"}
    else:
        columns = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}
    entry: dict[str, Any] = {
        "file_name": str(Path(plan.data_source).resolve()) if plan.data_source else "",
        "columns": columns,
    }
    if fmt.form != "prompt":
        entry |= {"formatting": "sharegpt", "tags": sharegpt_tags(fmt)}
    if run.method == "dpo":
        entry["ranking"] = True
    return entry
