"""OpenRLHF: `openrlhf/train_<method>.sh`, a `deepspeed --module openrlhf.cli.train_sft|train_dpo|
train_rm` command line (OpenRLHF 0.11.2 flag names, `openrlhf/cli/train_sft.py`, `train_dpo.py`,
`train_rm.py`). OpenRLHF builds its DeepSpeed config from the flags (`openrlhf/utils/deepspeed/
deepspeed_utils.py get_train_ds_config`), so there is no JSON beside it. OpenRLHF has no trainer
for ORPO, SimPO or KTO (`NO_TRAINER`): their script says so and exits 2, running nothing."""

from __future__ import annotations

import shlex
from typing import Any

from memfit.exports.common import (
    ADAM_BETAS,
    ADAM_EPS,
    OPENRLHF_VERSION,
    ExportPlan,
    SourceShape,
    header,
    int_alpha,
    not_expressible,
    pref_values,
    source_format,
    targets,
    tiled_mlp_missing,
)

# The methods OpenRLHF 0.11.2 has no trainer for: its openrlhf/cli holds train_sft, train_dpo,
# train_rm and train_ppo_ray only (train_kto was removed in 0.9.6, commit 6a981c8c "refactor: remove
# KTO, PRM, KD, batch_inference, and interactive_chat modules")
NO_TRAINER = {
    "orpo": "OpenRLHF 0.11.2 has no ORPO trainer: its DPO trainer (train_dpo) always holds a reference model and "
    "has no odds-ratio loss",
    "simpo": "OpenRLHF 0.11.2 has no SimPO trainer: its DPO trainer (train_dpo) always holds a reference model "
    "and has no length-normalised reward or target margin",
    "kto": "OpenRLHF 0.11.2 has no KTO trainer: openrlhf.cli.train_kto was removed in OpenRLHF 0.9.6",
}


def openrlhf_script(plan: ExportPlan) -> tuple[str, list[str]]:
    """(bash script, levers OpenRLHF 0.11.2 cannot express): `deepspeed --module openrlhf.cli.train_<method>`;
    for a method without an OpenRLHF trainer (`NO_TRAINER`) a script that says so and exits 2."""
    run, c = plan.run, plan.run.cand
    if run.method in NO_TRAINER:
        return _no_trainer_script(plan)
    missing: list[str] = []
    a: list[tuple[str, Any]] = [("--model.model_name_or_path", run.model_path)]
    if run.method == "dpo":
        a.append(("--ref.model_name_or_path", run.ref_model_path or run.model_path))
    a += _data_args(plan, missing)
    # batch
    a += [("--train.micro_batch_size", c.micro_batch), ("--train.batch_size", plan.global_batch)]
    a += _deepspeed_args(plan, missing)
    a += _optimizer_args(plan, missing)
    a += {"sft": _sft_args, "dpo": _dpo_args, "rm": _rm_args}[run.method](plan, missing)
    a += _bookkeeping_args(plan, missing)
    launcher = ["deepspeed", "--num_gpus", str(plan.num_gpus)]
    if plan.num_nodes > 1:
        launcher += ["--num_nodes", str(plan.num_nodes), "--hostfile", "hostfile"]
        missing.append(
            f"{plan.num_nodes} nodes: DeepSpeed's launcher needs a hostfile (ssh between nodes), not written"
        )
    launcher += ["--module", f"openrlhf.cli.train_{run.method}"]
    lines = [
        "#!/usr/bin/env bash",
        *header(plan, f"OpenRLHF {OPENRLHF_VERSION}"),
        "# not expressible in OpenRLHF's flags (this command differs from memfit's run here):",
    ]
    lines += not_expressible(missing)
    lines += ["set -euo pipefail", " ".join(launcher) + " \\"]
    argv = openrlhf_argv(a)
    lines += [f"  {' '.join(shlex.quote(t) for t in group)} \\" for group in _groups(argv)]
    lines[-1] = lines[-1].removesuffix(" \\")
    return "\n".join(lines) + "\n", missing


def _no_trainer_script(plan: ExportPlan) -> tuple[str, list[str]]:
    """The script of a method OpenRLHF has no trainer for: the statement, and exit 2 if run."""
    import textwrap

    why = NO_TRAINER[plan.run.method]
    statement = f"{why}. memfit wrote no command; the LLaMA-Factory and TRL exports (exports/llamafactory, exports/hf) train this configuration."
    lines = ["#!/usr/bin/env bash", *header(plan, f"OpenRLHF {OPENRLHF_VERSION}")]
    lines += ["# " + line for line in textwrap.wrap(statement, 100)]
    lines += [f"echo {shlex.quote(statement)} >&2", "exit 2"]
    return "\n".join(lines) + "\n", [why]


def _data_args(plan: ExportPlan, missing: list[str]) -> list[tuple[str, Any]]:
    """Dataset flags: memfit's rows {prompt, response} / {prompt, chosen, rejected}, chat template applied."""
    run, c = plan.run, plan.run.cand
    a: list[tuple[str, Any]] = []
    if plan.data_source:
        a.append(("--data.dataset", plan.data_source))
    else:
        missing.append("data: no data source in the config (plan only); set --data.dataset")
    fmt = source_format(plan.data_source)
    a += _sft_data_args(plan, fmt) if run.method == "sft" else _pair_data_args(fmt, missing)
    if fmt.sharegpt_turns:
        missing.append(
            f"ShareGPT turns ({{from, value}}) under `{fmt.key or 'chosen'}`: OpenRLHF hands the turns to the "
            "tokenizer's chat template as they are, which reads {role, content}; convert the rows first"
        )
    a.append(("--data.apply_chat_template", True))
    a.append(("--data.max_len", c.seq_len))
    return a


def _sft_data_args(plan: ExportPlan, fmt: SourceShape) -> list[tuple[str, Any]]:
    """SFT columns; chat rows: the conversation column, loss on every assistant turn or the last."""
    if fmt.form != "chat":
        return [("--data.input_key", "prompt"), ("--data.output_key", "response")]
    a: list[tuple[str, Any]] = [("--data.input_key", fmt.key)]
    if plan.assistant_loss == "all":
        # datasets/sft_dataset.py: --data.multiturn labels every assistant turn of the conversation;
        # without it (no output key) the last turn is the response and the rest the prompt
        a.append(("--data.multiturn", True))
    return a


def _pair_data_args(fmt: SourceShape, missing: list[str]) -> list[tuple[str, Any]]:
    """DPO's and the reward model's columns (datasets/reward_dataset.py serves both); conversational
    pairs without a prompt column: OpenRLHF's implicit prompt."""
    a: list[tuple[str, Any]] = []
    if fmt.form != "chat_pairs":
        a.append(("--data.prompt_key", "prompt"))
    elif fmt.key is None:
        # datasets/reward_dataset.py (is_dpo, no prompt key): the prompt is chosen[:-1], the last turn
        # the response; memfit's implicit prompt is the shared prefix (the same when only the last turn differs)
        missing.append(
            "implicit-prompt pairs: OpenRLHF takes all of chosen but its last turn as the prompt; memfit takes "
            "the prefix chosen and rejected share"
        )
    else:
        a.append(("--data.prompt_key", fmt.key))
    if fmt.turn_objects:  # LLaMA-Factory's ranking rows
        missing.append(
            "chosen/rejected as single turn objects: OpenRLHF takes turn lists (TRL's conversational "
            "format); convert the rows first"
        )
    return a + [("--data.chosen_key", "chosen"), ("--data.rejected_key", "rejected")]


def _deepspeed_args(plan: ExportPlan, missing: list[str]) -> list[tuple[str, Any]]:
    """DeepSpeed levers: ZeRO, offload, checkpointing, attention, precision, LoRA/QLoRA."""
    run, c = plan.run, plan.run.cand
    a: list[tuple[str, Any]] = []
    a.append(("--ds.zero_stage", c.zero))
    if c.zero >= 2:
        # memfit: overlap_comm + contiguous_gradients from ZeRO-2 on
        a.append(("--ds.overlap_comm", True))
    if c.offload_optimizer == "cpu":
        a.append(("--ds.adam_offload", True))
        if not c.pin_memory:
            missing.append("pin_memory false: OpenRLHF always pins the offloaded optimizer (get_train_ds_config)")
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
    if run.kernels == "liger":  # train_sft/train_dpo: Actor(use_liger_kernel=...) (openrlhf/cli/train_dpo.py)
        a.append(("--ds.use_liger_kernel", True))
    if c.precision in ("bf16", "fp16"):
        a.append(("--ds.param_dtype", c.precision))
    else:
        missing.append(
            "precision fp32: --ds.param_dtype takes bf16 or fp16 only; this command trains in bf16 (the default)"
        )
    if c.finetune in ("lora", "qlora"):
        a += [
            ("--ds.lora.rank", c.lora_rank),
            ("--ds.lora.alpha", int_alpha(plan, "OpenRLHF", missing)),
            ("--ds.lora.dropout", run.lora_dropout),
            ("--ds.lora.target_modules", targets(run)),
        ]
        if c.finetune == "qlora":
            a.append(("--ds.load_in_4bit", True))
    if c.loss_impl == "chunked":
        missing.append("loss_impl chunked: no chunked-vocabulary loss flag (full logits are materialised)")
    if c.sequence_parallel > 1:
        missing.append(
            f"sequence_parallel {c.sequence_parallel}: no DeepSpeed Ulysses flag (--ring_attn_size is ring "
            "attention, another scheme with other memory)"
        )
    if c.activation_offload:
        missing.append("activation_offload: no activation offload flag")
    tiled_mlp_missing(c, "OpenRLHF", missing)
    return a


def _optimizer_args(plan: ExportPlan, missing: list[str]) -> list[tuple[str, Any]]:
    """AdamW, clipping, the cosine schedule with warmup, epochs and seed."""
    run = plan.run
    a: list[tuple[str, Any]] = [
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
        missing.append(f"max_steps {run.max_steps}: OpenRLHF counts whole epochs only (--train.max_epochs)")
    elif float(epochs) != int(epochs):
        missing.append(f"epochs {epochs}: --train.max_epochs is an integer; {max(1, round(epochs))} written")
    a.append(("--train.max_epochs", max(1, round(epochs))))
    a.append(("--train.seed", run.seed))
    return a


def _sft_args(plan: ExportPlan, missing: list[str]) -> list[tuple[str, Any]]:
    """SFT: what the loss scores, packing and padding_free."""
    run = plan.run
    a: list[tuple[str, Any]] = []
    if run.loss_on == "all":
        missing.append(
            "loss_on all: OpenRLHF scores the output only (--model.pretrain_mode_enable scores a plain "
            "text column, another data format)"
        )
    return a + _packing_samples(plan, missing)


def _packing_samples(plan: ExportPlan, missing: list[str]) -> list[tuple[str, Any]]:
    """memfit's `packing` (SFT) and `padding_free` (SFT, DPO, rm): OpenRLHF's --ds.packing_samples runs a
    micro batch's samples as one row, each attending within itself (flash-attention varlen)."""
    run, c = plan.run, plan.run.cand
    if not (run.packing or run.padding_free):
        return []
    if c.attn != "flash":
        lever = "packing" if run.packing else "padding_free"
        missing.append(f"{lever} with attn {c.attn}: OpenRLHF packs with flash_attention_2 only (it switches to it)")
    return [("--ds.packing_samples", True)]


def _dpo_args(plan: ExportPlan, missing: list[str]) -> list[tuple[str, Any]]:
    """DPO: beta, loss type, label smoothing, the reference, padding_free."""
    run, c = plan.run, plan.run.cand
    a: list[tuple[str, Any]] = []
    dpo = run.dpo
    a.append(("--model.beta", dpo.get("beta", 0.1)))
    loss = dpo.get("loss_type", "sigmoid")
    if loss == "ipo":
        a.append(("--model.ipo_enable", True))
    elif loss != "sigmoid":
        missing.append(f"loss_type {loss}: OpenRLHF has the sigmoid (DPO) and IPO losses only")
    a.append(("--model.label_smoothing", dpo.get("label_smoothing", 0.0)))
    if c.ref != "model":
        missing.append(f"ref {c.ref}: OpenRLHF always holds a reference model (closest memory lever: --ref.offload)")
    return a + _packing_samples(plan, missing)


def _rm_args(plan: ExportPlan, missing: list[str]) -> list[tuple[str, Any]]:
    """The reward model: the Bradley-Terry loss (`sigmoid`: models/loss.py PairWiseLoss), the margin."""
    a: list[tuple[str, Any]] = [("--model.loss_type", "sigmoid")]
    if source_format(plan.data_source).margin:
        # trainer/rm_trainer.py: -logsigmoid(r_c - r_r - margin) with the rows' `margin` (datasets/reward_dataset.py)
        a.append(("--model.margin_loss_enable", True))
    c = pref_values(plan.run)["center_rewards_coefficient"]
    if c is not None:
        missing.append(f"center_rewards_coefficient {c}: OpenRLHF's reward loss has no centering term")
    return a + _packing_samples(plan, missing)  # trainer/rm_trainer.py: the packed pairs' rewards per sample


def _bookkeeping_args(plan: ExportPlan, missing: list[str]) -> list[tuple[str, Any]]:
    """Output, checkpoints, logging; the held-out split OpenRLHF cannot take."""
    run = plan.run
    a: list[tuple[str, Any]] = []
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
    return a


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
    body = " ".join(line.removesuffix("\\") for line in text.splitlines() if not line.startswith(("#", "set ")))
    toks = shlex.split(body)
    return toks[toks.index("--module") + 2 :]
