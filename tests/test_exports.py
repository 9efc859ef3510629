"""memfit.exports: the selected configuration as OpenRLHF, LLaMA-Factory and HF TrainingArguments files,
each checked by that tool's own parser where it is installed, else against its argument names."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import json
import os
from pathlib import Path

import pytest
import yaml

from memfit import exports
from memfit.train import dsconfig
from memfit.train.run_config import RunConfig

REPO = Path(__file__).resolve().parents[1]

# OpenRLHF 0.11.2 (pip install openrlhf==0.11.2, no deps): every `parser.add_argument` flag of
# openrlhf/cli/train_sft.py and openrlhf/cli/train_dpo.py (the `if __name__ == "__main__"` block).
_OPENRLHF_COMMON = {
    "--ckpt.output_dir", "--ckpt.save_steps", "--ckpt.save_hf", "--ckpt.disable_ds", "--logger.logging_steps",
    "--eval.steps", "--ckpt.path", "--ckpt.max_num", "--ckpt.max_mem", "--ckpt.load_enable",
    "--ds.use_universal_ckpt", "--train.micro_batch_size", "--train.batch_size",
    "--model.gradient_checkpointing_enable", "--ds.deepcompile", "--train.seed", "--train.full_determinism_enable",
    "--local_rank", "--ds.zero_stage", "--ds.param_dtype", "--ds.zpg", "--ds.adam_offload",
    "--ds.attn_implementation", "--ds.experts_implementation", "--ds.use_liger_kernel", "--ds.grad_accum_dtype",
    "--ds.overlap_comm", "--model.gradient_checkpointing_reentrant", "--data.disable_fast_tokenizer",
    "--data.dataloader_num_workers", "--ds.tensor_parallel_size", "--train.max_epochs", "--model.aux_loss_coef",
    "--model.model_name_or_path", "--optim", "--muon.lr", "--muon.momentum", "--muon.ns_steps", "--muon.nesterov",
    "--muon.no_nesterov", "--adam.lr", "--adam.betas", "--adam.eps", "--adam.weight_decay", "--lr_scheduler",
    "--lr_warmup_ratio", "--min_lr_ratio", "--max_norm", "--ds.ring_attn_size", "--ds.ring_attn_head_stride",
    "--ds.load_in_4bit", "--ds.lora.rank", "--ds.lora.alpha", "--ds.lora.target_modules", "--ds.lora.dropout",
    "--ds.packing_samples", "--data.dataset", "--data.dataset_probs", "--eval.dataset", "--data.dataset_split",
    "--eval.split", "--data.max_samples", "--data.input_template", "--data.apply_chat_template",
    "--data.tokenizer_chat_template", "--data.max_len", "--logger.wandb.key", "--logger.wandb.org",
    "--logger.wandb.group", "--logger.wandb.project", "--logger.wandb.run_name", "--logger.tensorboard_dir",
    "--use_ms",
}  # fmt: skip
OPENRLHF_FLAGS = {
    "sft": _OPENRLHF_COMMON | {"--model.pretrain_mode_enable", "--data.multiturn", "--data.input_key",
                               "--data.output_key"},
    "dpo": _OPENRLHF_COMMON | {"--ref.offload", "--model.beta", "--model.ipo_enable", "--model.label_smoothing",
                               "--model.nll_loss_coef", "--ref.model_name_or_path", "--data.prompt_key",
                               "--data.chosen_key", "--data.rejected_key"},
}  # fmt: skip
OPENRLHF_CHOICES = {"--ds.param_dtype": {"bf16", "fp16"}}  # train_sft.py/train_dpo.py `choices=`

# LLaMA-Factory 0.9.5 (pip install llamafactory==0.9.5): the fields memfit can write, as declared in
# src/llamafactory/hparams/model_args.py (model_name_or_path, flash_attn, disable_gradient_checkpointing,
# quantization_*, enable_liger_kernel), data_args.py (dataset, dataset_dir, cutoff_len, train_on_prompt, packing,
# neat_packing, val_size) and finetuning_args.py (stage, finetuning_type, lora_*, pref_*,
# dpo_label_smoothing, ref_model). Its TrainingArguments subclass transformers' Seq2SeqTrainingArguments.
LLAMAFACTORY_FIELDS = {
    "model_name_or_path", "flash_attn", "disable_gradient_checkpointing", "quantization_bit",
    "quantization_method", "quantization_type", "double_quantization", "dataset", "dataset_dir", "cutoff_len",
    "train_on_prompt", "packing", "neat_packing", "val_size", "stage", "finetuning_type", "lora_rank", "lora_alpha",
    "lora_dropout", "lora_target", "pref_beta", "pref_loss", "dpo_label_smoothing", "ref_model", "mask_history",
    "enable_liger_kernel",
}  # fmt: skip
LLAMAFACTORY_CHOICES = {
    "flash_attn": {
        "auto",
        "disabled",
        "sdpa",
        "fa2",
        "fa3",
    },  # extras/constants.py AttentionFunction
    "pref_loss": {
        "sigmoid",
        "hinge",
        "ipo",
        "kto_pair",
        "orpo",
        "simpo",
    },  # finetuning_args.py RLHFArguments
    "stage": {"pt", "sft", "rm", "ppo", "dpo", "kto"},
    "finetuning_type": {"lora", "oft", "freeze", "full"},
}


def _plan(tmp_path: Path, method: str, cand: dict, total_steps: int | None = 40, **run) -> exports.ExportPlan:
    """An export plan of one rank (the HF check below runs in this single process)."""
    r = RunConfig(
        method=method,
        model_path="models/base",
        data_dir="data",
        out_dir="results/m/g/x/train",
        candidate={"seq_len": 64, "micro_batch": 4, "grad_accum": 2, **cand},
        lr=2e-4,
        warmup_steps=5,
        epochs=2,
        **({"dpo": {"beta": 0.2, "loss_type": "sigmoid"}} if method == "dpo" else {}) | run,
    )
    ds = dsconfig.for_run(r, 1, total_steps, hidden_size=64)
    warmup = (
        None if total_steps is None else dsconfig.schedule_steps(dataclasses.replace(r, max_steps=total_steps), None)[1]
    )
    files = exports.paths(tmp_path, method)
    return exports.ExportPlan(run=r, ds_config=ds, num_gpus=1, num_nodes=1, total_steps=total_steps,
                              warmup_steps=warmup, data_source=str(REPO / f"data/demo/{method}.jsonl"),
                              eval_fraction=0.05, files=files)  # fmt: skip


CASES = {
    # the demo's kind of choice: full fp32 SFT, ZeRO-2, packing, loss on the prompt too
    "sft-full-fp32-packed": (
        "sft",
        {"zero": 2, "precision": "fp32"},
        {"packing": True, "loss_on": "all"},
    ),
    "dpo-lora-z3-offload-ref-adapter-ipo": (
        "dpo",
        {
            "zero": 3,
            "offload_optimizer": "cpu",
            "offload_param": "cpu",
            "pin_memory": False,
            "finetune": "lora",
            "lora_rank": 8,
            "ref": "adapter",
            "grad_ckpt": True,
            "attn": "flash",
            "precision": "bf16",
        },
        {"dpo": {"beta": 0.3, "loss_type": "ipo", "label_smoothing": 0.0}},
    ),  # fmt: skip
    "sft-qlora-chunked": (
        "sft",
        {
            "zero": 1,
            "finetune": "qlora",
            "lora_rank": 16,
            "loss_impl": "chunked",
            "precision": "bf16",
        },
        {"lora_alpha": 24.5},
    ),  # fmt: skip
    "dpo-full-precomputed-hinge": (
        "dpo",
        {"zero": 2, "ref": "precomputed", "precision": "bf16"},
        {"dpo": {"beta": 0.1, "loss_type": "hinge"}, "padding_free": True},
    ),
}


@pytest.fixture(params=list(CASES))
def written(request, tmp_path):
    method, cand, run = CASES[request.param]
    plan = _plan(tmp_path, method, cand, **run)
    return request.param, plan, exports.write_all(plan)


# --------------------------------------------------------------------------- OpenRLHF
def _openrlhf_parser(cli_file: Path) -> argparse.ArgumentParser:
    """OpenRLHF's own argument parser, built from its source without importing OpenRLHF (which needs
    CUDA-only packages): the `parser.add_argument(...)` statements of the `__main__` block, executed."""
    tree = ast.parse(cli_file.read_text())
    main = next(n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
    calls = [s for s in main.body if isinstance(s, ast.Expr) and "parser.add_argument" in ast.unparse(s)]
    ns: dict = {"argparse": argparse, "datetime": __import__("datetime").datetime}
    exec("parser = argparse.ArgumentParser()\n" + "\n".join(ast.unparse(s) for s in calls), ns)  # noqa: S102
    return ns["parser"]


def _openrlhf_source() -> Path | None:
    """The openrlhf package directory: MEMFIT_OPENRLHF_SRC, else an installed openrlhf (not imported)."""
    if os.environ.get("MEMFIT_OPENRLHF_SRC"):
        return Path(os.environ["MEMFIT_OPENRLHF_SRC"])
    spec = importlib.util.find_spec("openrlhf")
    return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None


def test_openrlhf_command_uses_only_its_flags_and_maps_the_levers(written):
    case, plan, files = written
    text = files["openrlhf"].read_text()
    method, c = plan.run.method, plan.run.cand
    assert f"deepspeed --num_gpus 1 --module openrlhf.cli.train_{method}" in text
    argv = exports.script_argv(text)
    flags = [t for t in argv if t.startswith("--")]
    assert set(flags) <= OPENRLHF_FLAGS[method], set(flags) - OPENRLHF_FLAGS[method]
    for flag, allowed in OPENRLHF_CHOICES.items():
        if flag in argv:
            assert argv[argv.index(flag) + 1] in allowed
    got = dict(zip(argv, argv[1:], strict=False))
    assert got["--ds.zero_stage"] == str(c.zero)
    assert got["--train.micro_batch_size"] == str(c.micro_batch)
    assert got["--train.batch_size"] == str(plan.global_batch)
    assert got["--data.max_len"] == str(c.seq_len)
    assert float(got["--adam.lr"]) == plan.run.lr
    # OpenRLHF warms up ceil(steps x ratio) steps: exactly memfit's warmup
    import math

    assert math.ceil(plan.total_steps * float(got["--lr_warmup_ratio"])) == plan.warmup_steps
    assert ("--model.gradient_checkpointing_enable" in argv) == c.grad_ckpt
    assert ("--ds.adam_offload" in argv) == (c.offload_optimizer == "cpu")
    if c.finetune != "full":
        assert got["--ds.lora.rank"] == str(c.lora_rank)
        assert ("--ds.load_in_4bit" in argv) == (c.finetune == "qlora")
    notes = text.split("set -euo pipefail")[0]  # the comment block listing what OpenRLHF cannot express
    expected = {
        "sft-full-fp32-packed": ["precision fp32", "loss_on all", "packing with attn sdpa"],
        "dpo-lora-z3-offload-ref-adapter-ipo": [
            "offload_param cpu",
            "pin_memory false",
            "ref adapter",
        ],
        "sft-qlora-chunked": ["loss_impl chunked", "lora_alpha 24.5"],
        "dpo-full-precomputed-hinge": ["loss_type hinge", "ref precomputed", "padding_free with attn sdpa"],
    }[case]
    for lever in expected:
        assert f"#   - {lever}" in notes
    if case == "dpo-lora-z3-offload-ref-adapter-ipo":
        assert "--model.ipo_enable" in argv and got["--model.beta"] == "0.3"
    assert ("--ds.packing_samples" in argv) == (plan.run.packing or plan.run.padding_free)

    src = _openrlhf_source()
    if src is None:
        return  # not installed here: the names above are the check
    args = _openrlhf_parser(src / "cli" / f"train_{method}.py").parse_args(argv)  # OpenRLHF's own parser
    assert getattr(args, "ds.zero_stage") == c.zero and getattr(args, "train.batch_size") == plan.global_batch


# --------------------------------------------------------------------------- LLaMA-Factory
def test_llamafactory_yaml_uses_only_its_arguments_and_points_at_memfits_deepspeed_json(written):
    from transformers import Seq2SeqTrainingArguments

    case, plan, files = written
    text = files["llamafactory"].read_text()
    y = yaml.safe_load(text)
    c = plan.run.cand
    known = LLAMAFACTORY_FIELDS | {f.name for f in dataclasses.fields(Seq2SeqTrainingArguments)}
    assert set(y) <= known, set(y) - known
    for key, allowed in LLAMAFACTORY_CHOICES.items():
        if key in y:
            assert y[key] in allowed
    assert json.loads(Path(y["deepspeed"]).read_text()) == plan.ds_config  # ZeRO, offload, precision exactly
    info = json.loads((Path(y["dataset_dir"]) / "dataset_info.json").read_text())
    assert Path(info[y["dataset"]]["file_name"]).exists()
    assert y["cutoff_len"] == c.seq_len and y["per_device_train_batch_size"] == c.micro_batch
    assert y["gradient_accumulation_steps"] == c.grad_accum and y["max_steps"] == plan.total_steps
    assert y["disable_gradient_checkpointing"] == (not c.grad_ckpt)
    if case == "dpo-lora-z3-offload-ref-adapter-ipo":
        # LoRA without ref_model: LLaMA-Factory's reference is the adapter-disabled model (ref adapter)
        assert "ref_model" not in y and y["pref_loss"] == "ipo" and y["lora_rank"] == 8
    if case == "dpo-full-precomputed-hinge":
        assert y["pref_loss"] == "hinge" and "#   - ref precomputed" in text
    if case == "sft-full-fp32-packed":
        assert y["packing"] and y["neat_packing"] and y["train_on_prompt"] and not y["bf16"]
    if case == "sft-qlora-chunked":
        assert y["quantization_bit"] == 4 and "#   - loss_impl chunked" in text

    if importlib.util.find_spec("llamafactory") is None:
        return  # not installed here (its pins conflict with this environment's): the names above are the check
    os.environ.setdefault("DISABLE_VERSION_CHECK", "1")
    from llamafactory.hparams.parser import (
        _parse_train_args,
    )  # HfArgumentParser over its 5 dataclasses

    model, data, training, finetuning, _ = _parse_train_args(_on_this_machine(dict(y)))
    # with packing LLaMA-Factory lowers cutoff_len by one itself (hparams/data_args.py __post_init__)
    assert (finetuning.stage, data.cutoff_len + bool(y.get("packing")), training.per_device_train_batch_size) == (
        plan.run.method, c.seq_len, c.micro_batch)  # fmt: skip
    assert model.model_name_or_path == plan.run.model_path


# --------------------------------------------------------------------------- HF TrainingArguments
def _on_this_machine(d: dict) -> dict:
    """The arguments as parsed here: without a GPU, TrainingArguments refuses bf16 unless `use_cpu`
    (a device check, not part of what is exported)."""
    import torch

    return d if torch.cuda.is_available() else d | {"use_cpu": True}


def test_hf_training_args_parse_and_agree_with_the_deepspeed_json(written, monkeypatch):
    from peft import LoraConfig
    from transformers import HfArgumentParser, TrainingArguments

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")  # TrainingArguments sets it; restored after
    case, plan, files = written
    d = json.loads(files["hf_args"].read_text())
    extra = d.pop("_memfit")
    assert json.loads(Path(d["deepspeed"]).read_text()) == plan.ds_config
    (args,) = HfArgumentParser(TrainingArguments).parse_dict(_on_this_machine(d), allow_extra_keys=False)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 2)
    assert args.max_steps == plan.total_steps and args.gradient_checkpointing == plan.run.cand.grad_ckpt
    # the HF Trainer's own check of its arguments against the DeepSpeed JSON (deepspeed_init calls it)
    args.hf_deepspeed_config.trainer_config_finalize(args, None, plan.total_steps)

    import trl

    cls = getattr(trl, extra["trl_class"].split(".")[1])
    (full,) = HfArgumentParser(cls).parse_dict(_on_this_machine(d) | extra["trl_fields"], allow_extra_keys=False)
    assert full.max_length == plan.run.cand.seq_len
    if plan.run.method == "dpo":
        assert full.beta == plan.run.dpo["beta"] and full.loss_type == [plan.run.dpo["loss_type"]]
        assert full.precompute_ref_log_probs == (plan.run.cand.ref == "precomputed")
        assert full.padding_free == plan.run.padding_free
    else:
        assert full.padding_free == plan.run.padding_free
        assert full.packing == plan.run.packing and full.completion_only_loss == (plan.run.loss_on == "response")
    if plan.run.cand.finetune != "full":
        lora = LoraConfig(**extra["peft_lora_config"])
        assert lora.r == plan.run.cand.lora_rank and lora.lora_alpha == plan.lora_alpha
    if case == "sft-qlora-chunked":
        assert any(m.startswith("loss_impl chunked") for m in extra["not_expressible"])


def test_hf_deepspeed_check_catches_a_mismatch(tmp_path, monkeypatch):
    """The consistency check above can fail: an lr that differs from the JSON's is refused."""
    from transformers import HfArgumentParser, TrainingArguments

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    plan = _plan(tmp_path, "sft", {"zero": 2})
    files = exports.write_all(plan)
    d = json.loads(files["hf_args"].read_text())
    d.pop("_memfit")
    d["learning_rate"] = 1e-3
    (args,) = HfArgumentParser(TrainingArguments).parse_dict(_on_this_machine(d), allow_extra_keys=False)
    with pytest.raises(ValueError, match="optimizer.params.lr"):
        args.hf_deepspeed_config.trainer_config_finalize(args, None, plan.total_steps)


def test_without_a_step_count_the_trainers_count_their_own(tmp_path):
    """A plan without prepared data: the JSON says "auto" and the tools get epochs, not max_steps."""
    plan = _plan(tmp_path, "sft", {"zero": 2}, total_steps=None)
    files = exports.write_all(plan)
    assert json.loads(files["hf_ds"].read_text())["scheduler"]["params"]["total_num_steps"] == "auto"
    y = yaml.safe_load(files["llamafactory"].read_text())
    assert "max_steps" not in y and y["num_train_epochs"] == 2
    assert "warmup_steps 5: OpenRLHF takes a ratio" in files["openrlhf"].read_text()


def test_the_workflow_declares_every_export(repo):
    """select_config's outputs in workflow/rules/plan.smk are exactly memfit.exports.FILES."""
    # res(...): the results root of the config's run: name (results/ or results/NAME/); whitespace-free
    text = "".join((repo / "workflow/rules/plan.smk").read_text().split())
    for key, rel in exports.FILES.items():
        assert f'{key}=res("{{model}}/{{gpu}}/{{method}}/{rel}"' in text, key


def test_a_sequence_parallel_selection_exports_its_batch_and_says_where_a_trainer_cannot_split(tmp_path):
    """2 ranks splitting each sequence: one data-parallel rank, the global batch micro x accum;
    the DeepSpeed JSON carries sequence_parallel_size, HF gets accelerate's ParallelismConfig
    fields, OpenRLHF and LLaMA-Factory say they have no Ulysses setting."""
    from memfit.exports.hf import hf_training_args
    from memfit.exports.llamafactory import llamafactory_config
    from memfit.exports.openrlhf import openrlhf_script

    plan = _plan(tmp_path, "sft", {"zero": 3, "sequence_parallel": 2, "precision": "bf16"})
    ds = dsconfig.for_run(plan.run, 2, 40, hidden_size=64)
    plan = dataclasses.replace(plan, ds_config=ds, num_gpus=2)
    assert plan.global_batch == 4 * 2 * 1 == ds["train_batch_size"] and ds["sequence_parallel_size"] == 2
    assert "x 1 data-parallel ranks (2 ranks, 2 per sequence)" in " ".join(exports.common.header(plan, "HF"))
    args, missing = hf_training_args(plan)
    assert args["_memfit"]["parallelism_config"] == {"sp_size": 2, "sp_backend": "deepspeed"}
    assert any(m.startswith("sequence_parallel 2: pass TrainingArguments(parallelism_config=") for m in missing)
    script, missing = openrlhf_script(plan)
    assert "--train.batch_size 8" in script and any("no DeepSpeed Ulysses flag" in m for m in missing)
    _, _, missing = llamafactory_config(plan)
    assert any("no DeepSpeed Ulysses argument" in m for m in missing)


def test_the_tiled_mlp_and_activation_offload_export_where_a_trainer_has_them(tmp_path):
    """TRL's activation_offloading and LLaMA-Factory's use_unsloth_gc move checkpointed activations
    to the host; no exported trainer has a tiled MLP, and each says so."""
    from memfit.exports.hf import hf_training_args
    from memfit.exports.llamafactory import llamafactory_config
    from memfit.exports.openrlhf import openrlhf_script

    levers = {"zero": 3, "grad_ckpt": True, "tiled_mlp": True, "activation_offload": True, "precision": "bf16"}
    plan = _plan(tmp_path, "sft", levers)
    plan = dataclasses.replace(plan, ds_config=dsconfig.for_run(plan.run, 2, 40, hidden_size=64), num_gpus=2)
    args, missing = hf_training_args(plan)
    assert args["_memfit"]["trl_fields"]["activation_offloading"] is True
    assert any(m.startswith("tiled_mlp: TrainingArguments/TRL has no tiled-MLP setting") for m in missing)
    y, _, missing = llamafactory_config(plan)
    assert y["use_unsloth_gc"] is True and any(m.startswith("tiled_mlp: LLaMA-Factory") for m in missing)
    _, missing = openrlhf_script(plan)
    assert any(m == "activation_offload: no activation offload flag" for m in missing)
    assert any(m.startswith("tiled_mlp: OpenRLHF") for m in missing)


# ------------------------------------------------------------------ chat rows (memfit.data.chat)
_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "and 2 + 4?"},
    {"role": "assistant", "content": "6"},
]
_SHAREGPT = [{"from": {"user": "human", "assistant": "gpt"}.get(t["role"], t["role"]), "value": t["content"]}
             for t in _TURNS]  # fmt: skip


def _chat_plan(tmp_path: Path, method: str, row: dict, name: str = "rows.jsonl", **plan) -> exports.ExportPlan:
    """An export plan whose data source is a file of `row`s in a chat form the data prep reads."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    src = tmp_path / name
    if name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([row, row]), src)
    else:
        src.write_text((json.dumps(row) + "\n") * 2)
    return dataclasses.replace(_plan(tmp_path, method, {"zero": 2}), data_source=str(src), **plan)


def _exported(plan: exports.ExportPlan) -> tuple[dict, list[str], dict, dict, str]:
    """(LLaMA-Factory YAML, OpenRLHF argv, its dataset_info entry, HF `_memfit`, every file's text)."""
    files = exports.write_all(plan)
    y = yaml.safe_load(files["llamafactory"].read_text())
    info = json.loads(files["llamafactory_dataset_info"].read_text())[f"memfit_{plan.run.method}"]
    argv = exports.script_argv(files["openrlhf"].read_text())
    flags = {t for t in argv if t.startswith("--")}
    assert flags <= OPENRLHF_FLAGS[plan.run.method], flags - OPENRLHF_FLAGS[plan.run.method]
    assert set(y) <= LLAMAFACTORY_FIELDS | _hf_fields(), set(y) - LLAMAFACTORY_FIELDS - _hf_fields()
    hf = json.loads(files["hf_args"].read_text())["_memfit"]
    text = "\n".join(files[k].read_text() for k in ("openrlhf", "llamafactory", "hf_args"))
    return y, argv, info, hf, text


def _hf_fields() -> set[str]:
    from transformers import Seq2SeqTrainingArguments

    return {f.name for f in dataclasses.fields(Seq2SeqTrainingArguments)}


@pytest.mark.parametrize("assistant_loss", ["all", "last"])
@pytest.mark.parametrize("name", ["rows.jsonl", "rows.parquet"])
def test_sft_messages_export_the_assistant_turns_memfit_scores(tmp_path, assistant_loss, name):
    plan = _chat_plan(tmp_path, "sft", {"messages": _TURNS}, name, assistant_loss=assistant_loss)
    y, argv, info, hf, text = _exported(plan)
    # LLaMA-Factory: sharegpt rows with role/content tags; mask_history scores the last turn only
    assert info["formatting"] == "sharegpt" and info["columns"] == {"messages": "messages"}
    assert info["tags"]["role_tag"] == "role" and info["tags"]["assistant_tag"] == "assistant"
    assert y["mask_history"] is (assistant_loss == "last")
    # OpenRLHF: the conversation column through the chat template; --data.multiturn scores every turn
    assert argv[argv.index("--data.input_key") + 1] == "messages"
    assert "--data.output_key" not in argv and "--data.apply_chat_template" in argv
    assert ("--data.multiturn" in argv) == (assistant_loss == "all")
    assert "last assistant turn only" not in text
    # TRL: the conversational rows as they are, loss on the assistant turns
    assert hf["trl_fields"]["assistant_only_loss"] is True
    assert "completion_only_loss" not in hf["trl_fields"]
    assert ("assistant_loss last: assistant_only_loss scores every assistant turn" in text) == (
        assistant_loss == "last"
    )


def test_sharegpt_conversations_export_their_tags_and_say_what_openrlhf_cannot_read(tmp_path):
    plan = _chat_plan(tmp_path, "sft", {"conversations": _SHAREGPT}, assistant_loss="last")
    y, argv, info, hf, text = _exported(plan)
    assert info["columns"] == {"messages": "conversations"}
    assert info["tags"] == {"role_tag": "from", "content_tag": "value", "user_tag": "human",
                            "assistant_tag": "gpt", "system_tag": "system"}  # fmt: skip
    assert y["mask_history"] is True
    assert argv[argv.index("--data.input_key") + 1] == "conversations"
    assert "--data.multiturn" not in argv
    assert "ShareGPT turns ({from, value}) under `conversations`" in text  # OpenRLHF's note


def test_prompt_response_rows_keep_the_plain_columns(tmp_path):
    plan = _chat_plan(tmp_path, "sft", {"prompt": "2 + 3?", "response": "5"})
    y, argv, info, hf, _ = _exported(plan)
    assert "formatting" not in info and "mask_history" not in y
    assert argv[argv.index("--data.output_key") + 1] == "response" and "--data.multiturn" not in argv
    assert "assistant_only_loss" not in hf["trl_fields"] and "completion_only_loss" in hf["trl_fields"]


def test_conversational_dpo_pairs_export_their_prompt_column_or_say_it_is_implicit(tmp_path):
    chosen, rejected = [{"role": "assistant", "content": "5"}], [{"role": "assistant", "content": "6"}]
    explicit = _chat_plan(tmp_path / "e", "dpo", {"prompt": _TURNS[:2], "chosen": chosen, "rejected": rejected})
    y, argv, info, hf, text = _exported(explicit)
    assert argv[argv.index("--data.prompt_key") + 1] == "prompt" and "--data.apply_chat_template" in argv
    assert info["formatting"] == "sharegpt" and info["ranking"] is True
    assert info["columns"] == {"messages": "prompt", "chosen": "chosen", "rejected": "rejected"}
    assert "conversational DPO pairs: LLaMA-Factory's sharegpt ranking rows" in text  # must be converted
    assert "implicit-prompt" not in text and "single turn objects" not in text  # TRL reads them as they are

    implicit = {"chosen": _TURNS[:2] + chosen, "rejected": _TURNS[:2] + rejected}
    _, argv, _, _, text = _exported(_chat_plan(tmp_path / "i", "dpo", implicit))
    assert "--data.prompt_key" not in argv  # OpenRLHF: chosen but its last turn is the prompt
    assert "implicit-prompt pairs: OpenRLHF takes all of chosen but its last turn" in text
    assert "and implicit prompts (no prompt column)" in text


def test_llamafactory_ranking_rows_export_as_they_are_for_llamafactory(tmp_path):
    row = {
        "conversations": _SHAREGPT[:2],
        "chosen": {"from": "gpt", "value": "5"},
        "rejected": {"from": "gpt", "value": "6"},
    }
    y, argv, info, hf, text = _exported(_chat_plan(tmp_path, "dpo", row))
    assert info["columns"] == {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}
    assert info["tags"]["role_tag"] == "from"
    assert "conversational DPO pairs" not in text  # LLaMA-Factory's own form
    assert argv[argv.index("--data.prompt_key") + 1] == "conversations"
    assert "chosen/rejected as single turn objects: OpenRLHF takes turn lists" in text
    assert "chosen/rejected as single turn objects (LLaMA-Factory's ranking rows): DPOTrainer" in text
