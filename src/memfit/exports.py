"""The selected configuration for the trainers users already run: OpenRLHF, LLaMA-Factory, HF.

`select_config` writes, beside selected.json (`FILES`, under exports/):

- `openrlhf/train_<method>.sh`: a `deepspeed --module openrlhf.cli.train_sft|train_dpo`
  command line (OpenRLHF 0.11.2 flag names, `openrlhf/cli/train_sft.py`, `train_dpo.py`).
  OpenRLHF builds its DeepSpeed config from the flags (`openrlhf/utils/deepspeed/
  deepspeed_utils.py get_train_ds_config`), so there is no JSON beside it.
- `llamafactory/train_<method>.yaml` + `llamafactory/ds_config.json` + `llamafactory/
  dataset_info.json`: a `llamafactory-cli train` config (LLaMA-Factory 0.9.5,
  `src/llamafactory/hparams/*.py`), the DeepSpeed JSON it points to, and the dataset registry
  LLaMA-Factory reads from `dataset_dir` (the file must carry that name).
- `hf/training_args.json` + `hf/ds_config.json`: `transformers.TrainingArguments` keyword
  arguments (`HfArgumentParser(TrainingArguments).parse_dict`) and their DeepSpeed JSON. The
  `_memfit` key is not an argument: it holds the TRL `SFTConfig`/`DPOConfig` fields (max length,
  packing, DPO beta/loss, reference) and peft's `LoraConfig`, which TrainingArguments has no
  field for, and the levers no field expresses.

Every file lists, in it, the selected levers the tool cannot express (`not_expressible`). The
DeepSpeed JSONs are memfit's ds_config.json (exactly what memfit's trainer runs); the HF and
LLaMA-Factory arguments are set so that the HF Trainer's consistency check between its
arguments and the JSON (`HfTrainerDeepSpeedConfig.trainer_config_process/finalize`) passes:
batch sizes, lr, AdamW betas/eps, weight decay, clipping, precision and, with `max_steps` set to
memfit's step count, the scheduler's steps. Paths are written as the workflow passes them
(relative to the workflow directory, like run.json).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit.atomic import write_json_atomic

if TYPE_CHECKING:
    from memfit.train import RunConfig

# the flag and argument names below are these releases' (pip install openrlhf==0.11.2 llamafactory==0.9.5)
OPENRLHF_VERSION = "0.11.2"
LLAMAFACTORY_VERSION = "0.9.5"

# Where each export lives, relative to the run directory (results/<model>/<gpu>/<method>).
FILES = {
    "openrlhf": "exports/openrlhf/train_{method}.sh",
    "llamafactory": "exports/llamafactory/train_{method}.yaml",
    "llamafactory_ds": "exports/llamafactory/ds_config.json",
    "llamafactory_dataset_info": "exports/llamafactory/dataset_info.json",
    "hf_args": "exports/hf/training_args.json",
    "hf_ds": "exports/hf/ds_config.json",
}

# What select_config writes instead of the exports when no candidate fits (a plan-only run).
NONE_FITS = "exports/NONE_FITS.txt"

ADAM_BETAS = (0.9, 0.95)  # memfit.dsconfig.build's AdamW defaults
ADAM_EPS = 1e-8


def paths(run_dir: str | Path, method: str) -> dict[str, Path]:
    """The export files of one run directory (the select_config outputs of workflow/rules/plan.smk)."""
    return {k: Path(run_dir) / v.format(method=method) for k, v in FILES.items()}


@dataclass(frozen=True)
class ExportPlan:
    """What every export is made of: the run, its DeepSpeed config and step schedule, the cluster."""

    run: RunConfig
    ds_config: dict[str, Any]  # memfit's ds_config.json
    num_gpus: int  # ranks per node
    num_nodes: int
    # optimizer steps (dsconfig.planned_steps); None: unknown (a plan without prepared data)
    total_steps: int | None
    warmup_steps: int | None
    data_source: str | None  # the raw dataset the workflow prepares (config data.<method>)
    eval_fraction: float = 0.0
    # paths(): where each export is written, for the references between them
    files: dict[str, Path] = dataclasses.field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.num_gpus * self.num_nodes

    @property
    def global_batch(self) -> int:
        c = self.run.cand
        return c.micro_batch * c.grad_accum * self.world

    @property
    def lora_alpha(self) -> float:
        # memfit.modeling's default: 2 x rank
        a = self.run.lora_alpha
        return a if a is not None else 2 * self.run.cand.lora_rank

    def file(self, key: str) -> str:
        return str(self.files.get(key, FILES[key].format(method=self.run.method)))


def _targets(run: RunConfig) -> list[str]:
    t = run.lora_targets
    return [t] if isinstance(t, str) else list(t)


def _int_alpha(plan: ExportPlan, tool: str, missing: list[str]) -> int:
    a = plan.lora_alpha
    if float(a) != int(a):
        missing.append(f"lora_alpha {a}: {tool} takes an integer alpha; {int(a)} written")
    return int(a)


def _source_format(source: str | None) -> str:
    """'messages' when the dataset's first row has a `messages` list, else 'prompt' (memfit.data's two SFT forms)."""
    if not source:
        return "prompt"
    p = Path(source)
    try:
        if p.suffix == ".jsonl":
            with p.open() as f:
                for line in f:
                    if line.strip():
                        return "messages" if "messages" in json.loads(line) else "prompt"
        elif p.suffix == ".parquet":
            import pyarrow.parquet as pq

            return "messages" if "messages" in pq.read_schema(p).names else "prompt"
    except (OSError, ValueError):
        pass
    return "prompt"


def _header(plan: ExportPlan, tool: str, comment: str = "#") -> list[str]:
    run, c = plan.run, plan.run.cand
    steps = (
        f"{plan.total_steps} optimizer steps, {plan.warmup_steps} warmup"
        if plan.total_steps is not None
        else "step count unknown (no prepared data): the tool counts its own"
    )
    return [
        f"{comment} memfit's selected {run.method} configuration for {tool}, written by select_config.",
        f"{comment} candidate {c.id}; global batch {plan.global_batch} = micro {c.micro_batch} x accum {c.grad_accum} "
        f"x {plan.world} ranks; {steps}.",
    ]


# --------------------------------------------------------------------------- OpenRLHF
def openrlhf_script(plan: ExportPlan) -> tuple[str, list[str]]:
    """(bash script, levers OpenRLHF 0.11.2 cannot express): `deepspeed --module openrlhf.cli.train_<method>`."""
    run, c = plan.run, plan.run.cand
    missing: list[str] = []
    a: list[tuple[str, Any]] = [("--model.model_name_or_path", run.model_path)]
    if run.method == "dpo":
        a.append(("--ref.model_name_or_path", run.ref_model_path or run.model_path))
    # data: memfit's rows {prompt, response} / {prompt, chosen, rejected}, chat template applied
    if plan.data_source:
        a.append(("--data.dataset", plan.data_source))
    else:
        missing.append("data: no data source in the config (plan only); set --data.dataset")
    if run.method == "sft":
        if _source_format(plan.data_source) == "messages":
            a.append(("--data.input_key", "messages"))
            missing.append(
                "SFT rows in `messages` form: memfit scores the last assistant turn only; OpenRLHF's "
                "SFTDataset with --data.input_key messages (no output key) does not split it the same way"
            )
        else:
            a += [("--data.input_key", "prompt"), ("--data.output_key", "response")]
    else:
        a += [
            ("--data.prompt_key", "prompt"),
            ("--data.chosen_key", "chosen"),
            ("--data.rejected_key", "rejected"),
        ]
    a.append(("--data.apply_chat_template", True))
    a.append(("--data.max_len", c.seq_len))
    # batch
    a += [("--train.micro_batch_size", c.micro_batch), ("--train.batch_size", plan.global_batch)]
    # DeepSpeed levers
    a.append(("--ds.zero_stage", c.zero))
    if c.zero >= 2:
        # memfit: overlap_comm + contiguous_gradients from ZeRO-2 on
        a.append(("--ds.overlap_comm", True))
    if c.offload_optimizer == "cpu":
        a.append(("--ds.adam_offload", True))
        if not c.pin_memory:
            missing.append(
                "pin_memory false: OpenRLHF always pins the offloaded optimizer (get_train_ds_config)"
            )
    if c.offload_param == "cpu":
        missing.append(
            "offload_param cpu: train_sft/train_dpo have no parameter-offload flag (only --ref.offload for "
            "the DPO reference)"
        )
    if c.offload_ratio != 1.0:
        missing.append(f"offload_ratio {c.offload_ratio}: no partial optimizer offload flag")
    if c.grad_ckpt:
        a.append(("--model.gradient_checkpointing_enable", True))
    a.append(
        (
            "--ds.attn_implementation",
            {"flash": "flash_attention_2", "sdpa": "sdpa", "eager": "eager"}[c.attn],
        )
    )
    if c.precision in ("bf16", "fp16"):
        a.append(("--ds.param_dtype", c.precision))
    else:
        missing.append(
            "precision fp32: --ds.param_dtype takes bf16 or fp16 only; this command trains in bf16 (the default)"
        )
    if c.finetune in ("lora", "qlora"):
        a += [
            ("--ds.lora.rank", c.lora_rank),
            ("--ds.lora.alpha", _int_alpha(plan, "OpenRLHF", missing)),
            ("--ds.lora.dropout", run.lora_dropout),
            ("--ds.lora.target_modules", _targets(run)),
        ]
        if c.finetune == "qlora":
            a.append(("--ds.load_in_4bit", True))
    if c.loss_impl == "chunked":
        missing.append(
            "loss_impl chunked: no chunked-vocabulary loss flag (full logits are materialised)"
        )
    # optimizer and schedule
    a += [
        ("--adam.lr", run.lr),
        ("--adam.betas", list(ADAM_BETAS)),
        ("--adam.eps", ADAM_EPS),
        ("--adam.weight_decay", run.weight_decay),
        ("--max_norm", run.grad_clip),
        ("--lr_scheduler", "cosine_with_min_lr"),
        ("--min_lr_ratio", run.min_lr_ratio),
    ]
    if plan.total_steps is not None and plan.warmup_steps is not None:
        # OpenRLHF warms up ceil(steps x ratio) steps (utils/deepspeed/deepspeed.py); half a step less
        # than memfit's warmup rounds up to exactly memfit's count
        ratio = max(plan.warmup_steps - 0.5, 0.0) / plan.total_steps
        a.append(("--lr_warmup_ratio", round(ratio, 8)))
    else:
        missing.append(
            f"warmup_steps {run.warmup_steps}: OpenRLHF takes a ratio of the run; the step count is unknown here"
        )
    epochs = run.epochs
    if run.max_steps:
        missing.append(
            f"max_steps {run.max_steps}: OpenRLHF counts whole epochs only (--train.max_epochs)"
        )
    elif float(epochs) != int(epochs):
        missing.append(
            f"epochs {epochs}: --train.max_epochs is an integer; {max(1, round(epochs))} written"
        )
    a.append(("--train.max_epochs", max(1, round(epochs))))
    a.append(("--train.seed", run.seed))
    # the method
    if run.method == "sft":
        if run.loss_on == "all":
            missing.append(
                "loss_on all: OpenRLHF scores the output only (--model.pretrain_mode_enable scores a plain "
                "text column, another data format)"
            )
        if run.packing:
            a.append(("--ds.packing_samples", True))
            if c.attn != "flash":
                missing.append(
                    f"packing with attn {c.attn}: OpenRLHF packs with flash_attention_2 only (it switches to it)"
                )
    else:
        dpo = run.dpo
        a.append(("--model.beta", dpo.get("beta", 0.1)))
        loss = dpo.get("loss_type", "sigmoid")
        if loss == "ipo":
            a.append(("--model.ipo_enable", True))
        elif loss != "sigmoid":
            missing.append(f"loss_type {loss}: OpenRLHF has the sigmoid (DPO) and IPO losses only")
        a.append(("--model.label_smoothing", dpo.get("label_smoothing", 0.0)))
        if c.ref != "model":
            missing.append(
                f"ref {c.ref}: OpenRLHF always holds a reference model (closest memory lever: --ref.offload)"
            )
    # bookkeeping
    out = f"{run.out_dir}_openrlhf"
    a += [
        ("--ckpt.output_dir", out),
        ("--ckpt.path", f"{out}/checkpoints"),
        ("--ckpt.max_num", run.keep_last),
        ("--logger.logging_steps", run.log_every),
    ]
    if run.save_every:
        a.append(("--ckpt.save_steps", run.save_every))
    if plan.eval_fraction:
        missing.append(
            f"held-out split (eval_fraction {plan.eval_fraction}, by prompt): OpenRLHF evaluates a separate "
            "--eval.dataset; memfit's split is not exported"
        )
    launcher = ["deepspeed", "--num_gpus", str(plan.num_gpus)]
    if plan.num_nodes > 1:
        launcher += ["--num_nodes", str(plan.num_nodes), "--hostfile", "hostfile"]
        missing.append(
            f"{plan.num_nodes} nodes: DeepSpeed's launcher needs a hostfile (ssh between nodes), not written"
        )
    launcher += ["--module", f"openrlhf.cli.train_{run.method}"]
    lines = [
        "#!/usr/bin/env bash",
        *_header(plan, f"OpenRLHF {OPENRLHF_VERSION}"),
        "# not expressible in OpenRLHF's flags (this command differs from memfit's run here):",
    ]
    lines += [f"#   - {m}" for m in missing] or ["#   (none)"]
    lines += ["set -euo pipefail", " ".join(launcher) + " \\"]
    argv = openrlhf_argv(a)
    lines += [f"  {' '.join(shlex.quote(t) for t in group)} \\" for group in _groups(argv)]
    lines[-1] = lines[-1].removesuffix(" \\")
    return "\n".join(lines) + "\n", missing


def openrlhf_argv(args: list[tuple[str, Any]]) -> list[str]:
    """Flags as argv: True is a bare switch, lists spread (nargs)."""
    out: list[str] = []
    for flag, value in args:
        if value is True:
            out.append(flag)
        elif isinstance(value, list):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def _groups(argv: list[str]) -> list[list[str]]:
    """argv as one flag and its values per line."""
    groups: list[list[str]] = []
    for tok in argv:
        if tok.startswith("--") or not groups:
            groups.append([tok])
        else:
            groups[-1].append(tok)
    return groups


def script_argv(text: str) -> list[str]:
    """The arguments after `--module <module>` in an exported script (for checking it with the tool's parser)."""
    body = " ".join(
        line.removesuffix("\\") for line in text.splitlines() if not line.startswith(("#", "set "))
    )
    toks = shlex.split(body)
    return toks[toks.index("--module") + 2 :]


# --------------------------------------------------------------------------- LLaMA-Factory
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
        targets = _targets(run)
        y |= {
            "lora_rank": c.lora_rank,
            "lora_alpha": _int_alpha(plan, "LLaMA-Factory", missing),
            "lora_dropout": run.lora_dropout,
            "lora_target": "all" if targets == ["all-linear"] else ",".join(targets),
        }
        if c.finetune == "qlora":  # memfit.modeling: bitsandbytes nf4, double quantization
            y |= {
                "quantization_bit": 4,
                "quantization_method": "bnb",
                "quantization_type": "nf4",
                "double_quantization": True,
            }
    y["flash_attn"] = {"flash": "fa2", "sdpa": "sdpa", "eager": "disabled"}[c.attn]
    y[
        "disable_gradient_checkpointing"
    ] = not c.grad_ckpt  # LLaMA-Factory checkpoints unless told not to
    y["deepspeed"] = plan.file("llamafactory_ds")
    # data: the registry beside this file; no `template`: LLaMA-Factory then parses the tokenizer's
    # chat template (data/template.py get_template_and_fix_tokenizer), as memfit renders prompts
    y |= {
        "dataset": name,
        "dataset_dir": str(Path(plan.file("llamafactory_dataset_info")).parent),
        "cutoff_len": c.seq_len,
    }
    fmt = _source_format(plan.data_source)
    missing.append(
        "truncation: LLaMA-Factory shortens prompt and response to fit cutoff_len (data/processor/"
        "processor_utils.py infer_seqlen); memfit never cuts a prompt (drops the row) and cuts responses only"
    )
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
    if c.loss_impl == "chunked":
        missing.append(
            "loss_impl chunked: no chunked-vocabulary loss option (closest: enable_liger_kernel, another kernel)"
        )
    y |= _hf_schedule(plan, missing)
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
        missing.append(
            f"held-out split: val_size {plan.eval_fraction} draws random rows; memfit splits by prompt"
        )
    if plan.world > 1 and plan.num_nodes > 1:
        missing.append(
            f"{plan.num_nodes} nodes: launch with FORCE_TORCHRUN=1 NNODES={plan.num_nodes} NODE_RANK=... "
            "MASTER_ADDR=... llamafactory-cli train (environment, not YAML)"
        )
    columns = (
        {"messages": "messages"}
        if fmt == "messages" and run.method == "sft"
        else {"prompt": "prompt", "response": "response"}
        if run.method == "sft"
        else {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}
    )
    entry: dict[str, Any] = {
        "file_name": str(Path(plan.data_source).resolve()) if plan.data_source else "",
        "columns": columns,
    }
    if fmt == "messages" and run.method == "sft":
        entry |= {
            "formatting": "sharegpt",
            "tags": {
                "role_tag": "role",
                "content_tag": "content",
                "user_tag": "user",
                "assistant_tag": "assistant",
                "system_tag": "system",
            },
        }
    if run.method == "dpo":
        entry["ranking"] = True
    if not plan.data_source:
        missing.append(
            "data: no data source in the config (plan only); set file_name in dataset_info.json"
        )
    return y, {name: entry}, missing


def _hf_schedule(plan: ExportPlan, missing: list[str]) -> dict[str, Any]:
    """TrainingArguments fields of the optimizer and schedule (HF and LLaMA-Factory).

    The DeepSpeed JSON's WarmupCosineLR replaces the HF scheduler; the HF fields below describe
    the same curve (linear warmup from 0, cosine to min_lr_ratio x lr) for a run without it."""
    run = plan.run
    out: dict[str, Any] = {
        "learning_rate": run.lr,
        "weight_decay": run.weight_decay,
        "max_grad_norm": run.grad_clip,
        "adam_beta1": ADAM_BETAS[0],
        "adam_beta2": ADAM_BETAS[1],
        "adam_epsilon": ADAM_EPS,
        "lr_scheduler_type": "cosine_with_min_lr",
        "lr_scheduler_kwargs": {"min_lr_rate": run.min_lr_ratio},
        "seed": run.seed,
        "data_seed": run.seed,
        "logging_steps": run.log_every,
        "save_total_limit": run.keep_last,
    }
    if plan.total_steps is not None:
        # memfit's step count (epochs x rows // global batch): with it the JSON's total_num_steps and
        # the Trainer's num_training_steps agree; the tool counts its own rows only without it
        out |= {"max_steps": plan.total_steps, "warmup_steps": plan.warmup_steps}
    else:
        out |= {"num_train_epochs": run.epochs, "warmup_steps": run.warmup_steps}
    if run.save_every:
        out |= {"save_strategy": "steps", "save_steps": run.save_every}
    missing.append(
        "scheduler phase: memfit steps DeepSpeed's WarmupCosineLR once after initialize (step 1 at the "
        "schedule's step 1); the HF Trainer does not, so its lr runs one step behind memfit's"
    )
    return out


# --------------------------------------------------------------------------- HF TrainingArguments
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
        **_hf_schedule(plan, missing),
    }
    if plan.eval_fraction:
        args |= {
            "eval_strategy": "steps",
            "eval_steps": run.eval_every,
            "per_device_eval_batch_size": c.micro_batch,
        }
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[c.precision]
    attn = {"flash": "flash_attention_2", "sdpa": "sdpa", "eager": "eager"}[c.attn]
    trl: dict[str, Any] = {
        "max_length": c.seq_len,
        "model_init_kwargs": {"attn_implementation": attn, "dtype": dtype},
    }
    if run.method == "sft":
        trl_class = "trl.SFTConfig"
        trl |= {"completion_only_loss": run.loss_on == "response", "packing": run.packing}
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
        if c.ref == "model" and c.finetune != "full":
            missing.append(
                "ref model with LoRA: pass DPOTrainer(ref_model=<a frozen copy>); without one TRL "
                "disables the adapter (memfit's ref adapter)"
            )
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
    if plan.eval_fraction:
        missing.append(
            f"held-out split (eval_fraction {plan.eval_fraction}, by prompt): pass your own eval_dataset"
        )
    args["_memfit"] = {
        "about": "not a TrainingArguments field: drop this key before TrainingArguments(**args) / "
        "HfArgumentParser(TrainingArguments).parse_dict(args)",
        "written_with": {"transformers": transformers.__version__},
        "candidate": c.id,
        "trl_class": trl_class,
        "trl_fields": trl,
        "peft_lora_config": peft,
        "not_expressible": missing,
    }
    return args, missing


# --------------------------------------------------------------------------- writing
def write_all(plan: ExportPlan) -> dict[str, Path]:
    """Write every export (each file atomically); returns their paths."""
    import yaml

    from memfit.atomic import write_text_atomic

    files = {k: Path(v) for k, v in (plan.files or paths(".", plan.run.method)).items()}
    script, _ = openrlhf_script(plan)
    write_text_atomic(files["openrlhf"], script)
    files["openrlhf"].chmod(0o755)
    lf, info, lf_missing = llamafactory_config(plan)
    head = _header(
        plan,
        f"LLaMA-Factory {LLAMAFACTORY_VERSION} (llamafactory-cli train {files['llamafactory']})",
    )
    head += [
        "# not expressible in LLaMA-Factory's arguments (this run differs from memfit's here):"
    ]
    head += [f"#   - {m}" for m in lf_missing] or ["#   (none)"]
    write_text_atomic(
        files["llamafactory"], "\n".join(head) + "\n" + yaml.safe_dump(lf, sort_keys=False)
    )
    write_json_atomic(files["llamafactory_ds"], plan.ds_config)
    write_json_atomic(files["llamafactory_dataset_info"], info)
    args, _ = hf_training_args(plan)
    write_json_atomic(files["hf_args"], args)
    write_json_atomic(files["hf_ds"], plan.ds_config)
    return files
