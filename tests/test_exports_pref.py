"""memfit.exports for rm, orpo, simpo and kto: what select_config writes for TRL (RewardConfig,
ORPOConfig, CPOConfig with loss_type simpo, KTOConfig, parsed here by TRL's own dataclasses),
LLaMA-Factory (stage rm, pref_loss orpo/simpo, stage kto) and OpenRLHF (train_rm; for ORPO, SimPO
and KTO a script that says OpenRLHF has no such trainer)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import math
import subprocess
from pathlib import Path

import pytest
import yaml
from test_exports import (
    _OPENRLHF_COMMON,
    LLAMAFACTORY_CHOICES,
    LLAMAFACTORY_FIELDS,
    OPENRLHF_CHOICES,
    _hf_fields,
    _on_this_machine,
    _openrlhf_parser,
    _openrlhf_source,
)

from memfit import exports
from memfit.train import dsconfig
from memfit.train.run_config import RunConfig

REPO = Path(__file__).resolve().parents[1]

# OpenRLHF 0.11.2's openrlhf/cli/train_rm.py (its `__main__` block): the shared flags but
# --ds.use_liger_kernel, and the reward model's own
OPENRLHF_RM_FLAGS = (_OPENRLHF_COMMON - {"--ds.use_liger_kernel"}) | {
    "--model.loss_type", "--model.margin_loss_enable", "--model.compute_fp32_loss_enable", "--ds.value_head_prefix",
    "--data.prompt_key", "--data.chosen_key", "--data.rejected_key",
}  # fmt: skip
# LLaMA-Factory 0.9.5's hparams/finetuning_args.py RLHFArguments fields beside those test_exports lists
LLAMAFACTORY_PREF_FIELDS = {"kto_chosen_weight", "kto_rejected_weight", "simpo_gamma", "pref_ftx"}

PAIRS = {"prompt": "2 + 3?", "chosen": "5", "rejected": "6"}
UNPAIRED = {"prompt": "2 + 3?", "completion": "5", "label": True}

# method -> (candidate levers, train.<method> hyperparameters, first data row): values off memfit's defaults
CASES = {
    "rm": ({"finetune": "lora", "lora_rank": 8}, {"center_rewards_coefficient": 0.01}, PAIRS | {"margin": 1.5}),
    "orpo": ({"precision": "bf16"}, {"beta": 0.25}, PAIRS),
    "simpo": ({"precision": "bf16"}, {"beta": 2.5, "simpo_gamma": 1.2}, PAIRS),
    "kto": ({"ref": "precomputed"}, {"beta": 0.3, "desirable_weight": 1.33, "undesirable_weight": 0.8}, UNPAIRED),
}


def _plan(tmp_path: Path, method: str, cand: dict, pref: dict, row: dict | None) -> exports.ExportPlan:
    """The export plan select_config builds for one rank, its data source a file of `row`s (None: no data)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    run = RunConfig(
        method=method,
        model_path="models/sft",
        data_dir="data",
        out_dir=f"results/m/g/{method}/train",
        candidate={"seq_len": 64, "micro_batch": 4, "grad_accum": 2, "zero": 2, **cand},
        lr=1e-5,
        warmup_steps=5,
        pref=pref,
    )
    src = None
    if row is not None:
        src = tmp_path / f"{method}.jsonl"
        src.write_text((json.dumps(row) + "\n") * 3)
    ds = dsconfig.for_run(run, 1, 40, hidden_size=64)
    return exports.ExportPlan(run=run, ds_config=ds, num_gpus=1, num_nodes=1, total_steps=40, warmup_steps=5,
                              data_source=str(src) if src else None, files=exports.paths(tmp_path, method))  # fmt: skip


@pytest.fixture(params=list(CASES))
def written(request, tmp_path):
    cand, pref, row = CASES[request.param]
    plan = _plan(tmp_path, request.param, cand, pref, row)
    return plan, exports.write_all(plan)


def test_the_exports_know_memfits_defaults():
    """A run whose train.<method> sets nothing exports the values memfit trains with (PREF_DEFAULTS
    repeats memfit.train.preference's, which memfit.exports may not import)."""
    from memfit.train import preference

    for method in preference.METHODS:
        assert exports.common.PREF_DEFAULTS[method] == dataclasses.asdict(preference.make_config(method)), method


# --------------------------------------------------------------------------- TRL
def test_trl_config_is_the_methods_own_and_its_dataclass_takes_every_field(written, monkeypatch):
    from peft import LoraConfig
    from transformers import HfArgumentParser, TrainingArguments

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    plan, files = written
    run = plan.run
    d = json.loads(files["hf_args"].read_text())
    extra = d.pop("_memfit")
    (args,) = HfArgumentParser(TrainingArguments).parse_dict(_on_this_machine(d), allow_extra_keys=False)
    args.hf_deepspeed_config.trainer_config_finalize(args, None, plan.total_steps)  # the JSON agrees

    module, name = extra["trl_class"].rsplit(".", 1)
    assert (module, name) == {
        "rm": ("trl", "RewardConfig"),
        "orpo": ("trl.experimental.orpo", "ORPOConfig"),
        "simpo": ("trl.experimental.cpo", "CPOConfig"),
        "kto": ("trl", "KTOConfig"),
    }[run.method]
    cls = getattr(importlib.import_module(module), name)
    (cfg,) = HfArgumentParser(cls).parse_dict(_on_this_machine(d) | extra["trl_fields"], allow_extra_keys=False)
    assert cfg.max_length == run.cand.seq_len
    if run.method == "rm":
        assert cfg.center_rewards_coefficient == 0.01
        lora = LoraConfig(**extra["peft_lora_config"])  # a sequence-classification adapter, the score head trained
        assert (lora.task_type, lora.modules_to_save, lora.r) == ("SEQ_CLS", ["score"], 8)
        assert any(
            n.startswith("margin: the rows carry a `margin`; RewardTrainer subtracts it") for n in extra["notes"]
        )
    elif run.method == "orpo":
        assert cfg.beta == 0.25 and cfg.model_init_kwargs["device_map"] is None
    elif run.method == "simpo":  # SimPO is CPOTrainer's simpo loss without the NLL term
        assert (cfg.loss_type, cfg.beta, cfg.simpo_gamma, cfg.cpo_alpha, cfg.label_smoothing) == (
            "simpo", 2.5, 1.2, 0.0, 0.0)  # fmt: skip
    else:
        assert (cfg.beta, cfg.desirable_weight, cfg.undesirable_weight) == (0.3, 1.33, 0.8)
        assert cfg.loss_type == "kto" and cfg.precompute_ref_log_probs is True
        assert any(m.startswith("KL batch: KTOTrainer pairs each row") for m in extra["not_expressible"])


# --------------------------------------------------------------------------- LLaMA-Factory
def test_llamafactory_yaml_names_the_stage_and_loss_with_the_runs_values(written):
    plan, files = written
    run = plan.run
    text = files["llamafactory"].read_text()
    y = yaml.safe_load(text)
    known = LLAMAFACTORY_FIELDS | LLAMAFACTORY_PREF_FIELDS | _hf_fields()
    assert set(y) <= known, set(y) - known
    for key, allowed in LLAMAFACTORY_CHOICES.items():
        if key in y:
            assert y[key] in allowed, (key, y[key])
    info = json.loads(files["llamafactory_dataset_info"].read_text())[y["dataset"]]
    assert info["file_name"] == plan.data_source
    got = {k: y.get(k) for k in ("stage", "pref_loss", "pref_beta", "simpo_gamma", "kto_chosen_weight",
                                 "kto_rejected_weight", "ref_model")}  # fmt: skip
    expected = {
        "rm": {"stage": "rm"},
        "orpo": {"stage": "dpo", "pref_loss": "orpo", "pref_beta": 0.25},
        "simpo": {"stage": "dpo", "pref_loss": "simpo", "pref_beta": 2.5, "simpo_gamma": 1.2},
        "kto": {"stage": "kto", "pref_beta": 0.3, "kto_chosen_weight": 1.33, "kto_rejected_weight": 0.8},
    }[run.method]
    assert got == {k: expected.get(k) for k in got}
    if run.method == "kto":  # unpaired rows: the label is LLaMA-Factory's kto_tag
        assert info["columns"] == {"prompt": "prompt", "response": "completion", "kto_tag": "label"}
        assert "ranking" not in info and "#   - ref precomputed: LLaMA-Factory's KTO trainer" in text
    else:
        assert info["ranking"] is True and info["columns"] == {"prompt": "prompt", "chosen": "chosen",
                                                               "rejected": "rejected"}  # fmt: skip
    if run.method == "rm":
        assert "#   - center_rewards_coefficient 0.01: LLaMA-Factory's reward loss has no centering term" in text
        assert "#   - margin: LLaMA-Factory's reward loss has no margin" in text
        assert y["lora_rank"] == 8


def test_llamafactory_simpo_takes_the_nll_weight_and_says_it_has_no_label_smoothing(tmp_path):
    plan = _plan(tmp_path, "simpo", {}, {"cpo_alpha": 0.5, "label_smoothing": 0.1}, PAIRS)
    text = exports.write_all(plan)["llamafactory"].read_text()
    y = yaml.safe_load(text)
    assert (y["pref_ftx"], y["pref_beta"], y["simpo_gamma"]) == (0.5, 0.1, 0.5)  # beta, gamma: memfit's defaults
    assert "dpo_label_smoothing" not in y  # LLaMA-Factory refuses it beside a loss other than sigmoid
    assert "#   - label_smoothing 0.1: LLaMA-Factory's SimPO loss has none" in text
    assert "#   - cpo_alpha 0.5 as pref_ftx" in text


# --------------------------------------------------------------------------- OpenRLHF
def test_openrlhf_trains_the_reward_model_with_its_margin(tmp_path):
    text = exports.write_all(_plan(tmp_path, "rm", *CASES["rm"]))["openrlhf"].read_text()
    assert "deepspeed --num_gpus 1 --module openrlhf.cli.train_rm" in text
    argv = exports.script_argv(text)
    flags = {t for t in argv if t.startswith("--")}
    assert flags <= OPENRLHF_RM_FLAGS, flags - OPENRLHF_RM_FLAGS
    for flag, allowed in OPENRLHF_CHOICES.items():
        if flag in argv:
            assert argv[argv.index(flag) + 1] in allowed
    got = dict(zip(argv, argv[1:], strict=False))
    assert got["--model.loss_type"] == "sigmoid" and "--model.margin_loss_enable" in argv
    assert (got["--data.prompt_key"], got["--data.chosen_key"], got["--data.rejected_key"]) == (
        "prompt", "chosen", "rejected")  # fmt: skip
    assert got["--ds.lora.rank"] == "8" and "--ref.model_name_or_path" not in argv
    assert "#   - center_rewards_coefficient 0.01: OpenRLHF's reward loss has no centering term" in text
    src = _openrlhf_source()
    if src is not None:  # OpenRLHF's own parser, where it is installed
        args = _openrlhf_parser(src / "cli" / "train_rm.py").parse_args(argv)
        assert getattr(args, "model.margin_loss_enable") is True


@pytest.mark.parametrize("method", ["rm", "orpo", "simpo"])
def test_padding_free_is_carried_where_a_trainer_has_it_and_listed_where_not(tmp_path, method):
    """memfit's padding_free (rm, ORPO, SimPO): OpenRLHF's reward-model trainer packs the pairs
    (--ds.packing_samples, flash attention only, which the notes say under sdpa); TRL's RewardConfig,
    ORPOConfig and CPOConfig have no padding_free, so their files list it as not expressible."""
    import dataclasses

    cand, pref, row = CASES[method]
    plan = _plan(tmp_path, method, cand, pref, row)
    plan = dataclasses.replace(plan, run=dataclasses.replace(plan.run, padding_free=True))
    files = exports.write_all(plan)
    cls = {"rm": "RewardConfig", "orpo": "ORPOConfig", "simpo": "CPOConfig"}[method]
    assert f"padding_free: {cls} has no padding_free" in files["hf_args"].read_text()
    if method == "rm":
        text = files["openrlhf"].read_text()
        assert "--ds.packing_samples" in exports.script_argv(text)
        assert "#   - padding_free with attn sdpa: OpenRLHF packs with flash_attention_2 only" in text


@pytest.mark.parametrize("method", ["orpo", "simpo", "kto"])
def test_openrlhf_says_it_has_no_trainer_and_its_script_runs_nothing(tmp_path, method):
    cand, pref, row = CASES[method]
    script = exports.write_all(_plan(tmp_path, method, cand, pref, row))["openrlhf"]
    text = script.read_text()
    assert "deepspeed" not in text and "--module" not in text
    name = {"orpo": "ORPO", "simpo": "SimPO", "kto": "KTO"}[method]
    assert f"# OpenRLHF 0.11.2 has no {name} trainer" in text
    done = subprocess.run([str(script)], capture_output=True, text=True, timeout=30)  # a user running it
    assert done.returncode == 2 and f"OpenRLHF 0.11.2 has no {name} trainer" in done.stderr
    assert "exports/llamafactory, exports/hf" in done.stderr


# --------------------------------------------------------------------------- data forms
def test_kto_from_pairs_tells_llamafactory_users_to_convert_and_trl_unpairs_itself(tmp_path):
    plan = _plan(tmp_path, "kto", {"ref": "model"}, {}, PAIRS)
    files = exports.write_all(plan)
    text = files["llamafactory"].read_text()
    y = yaml.safe_load(text)
    info = json.loads(files["llamafactory_dataset_info"].read_text())["memfit_kto"]
    assert info["file_name"] == "" and "#   - KTO from pairs: LLaMA-Factory's KTO stage reads unpaired rows" in text
    assert y["ref_model"] == "models/sft" and y["pref_beta"] == 0.1  # memfit's default beta
    hf = json.loads(files["hf_args"].read_text())["_memfit"]
    assert any("KTOTrainer unpairs them itself" in n for n in hf["notes"])
    assert hf["trl_fields"]["precompute_ref_log_probs"] is False


def test_kto_with_a_lora_reference_adapter_and_conversational_rows(tmp_path):
    row = {"prompt": [{"role": "user", "content": "2 + 3?"}], "completion": [{"role": "assistant", "content": "5"}],
           "label": False}  # fmt: skip
    plan = _plan(tmp_path, "kto", {"ref": "adapter", "finetune": "lora", "lora_rank": 4}, {}, row)
    files = exports.write_all(plan)
    text = files["llamafactory"].read_text()
    y = yaml.safe_load(text)
    assert "ref_model" not in y  # LoRA without ref_model: the adapter-disabled model, as memfit's ref adapter
    assert "#   - conversational KTO rows (TRL's format)" in text
    assert json.loads(files["llamafactory_dataset_info"].read_text())["memfit_kto"]["file_name"] == ""
    hf = json.loads(files["hf_args"].read_text())["_memfit"]
    assert hf["peft_lora_config"]["task_type"] == "CAUSAL_LM"
    assert not any(m.startswith("ref model with LoRA") for m in hf["not_expressible"])


def test_conversational_pairs_say_what_llamafactory_cannot_read_for_every_pair_method(tmp_path):
    row = {"prompt": [{"role": "user", "content": "2 + 3?"}], "chosen": [{"role": "assistant", "content": "5"}],
           "rejected": [{"role": "assistant", "content": "6"}]}  # fmt: skip
    for method, name in (("rm", "reward-model"), ("orpo", "ORPO"), ("simpo", "SimPO")):
        files = exports.write_all(_plan(tmp_path / method, method, {}, {}, row))
        info = json.loads(files["llamafactory_dataset_info"].read_text())[f"memfit_{method}"]
        assert info["formatting"] == "sharegpt" and info["ranking"] is True
        assert f"#   - conversational {name} pairs: LLaMA-Factory's sharegpt ranking rows" in (
            files["llamafactory"].read_text())  # fmt: skip


def test_llamafactory_parses_the_exports_where_installed(written):
    if importlib.util.find_spec("llamafactory") is None:
        pytest.skip("llamafactory is not installed here (its pins conflict with this environment's)")
    import os

    os.environ.setdefault("DISABLE_VERSION_CHECK", "1")
    from llamafactory.hparams.parser import _parse_train_args

    plan, files = written
    y = yaml.safe_load(files["llamafactory"].read_text())
    _, _, training, finetuning, _ = _parse_train_args(_on_this_machine(dict(y)))
    assert finetuning.stage == y["stage"] and training.per_device_train_batch_size == plan.run.cand.micro_batch


@pytest.mark.parametrize("method", list(CASES))
def test_trl_trains_a_step_from_the_exported_files(demo_model, tmp_path, method, monkeypatch):
    """What a user pastes: the TrainingArguments and the TRL fields of the export, the export's LoRA
    config and data file, given to TRL's own trainer for the method, train one step (here on the CPU,
    without the DeepSpeed JSON: test_trl_config_is_the_methods_own... checks that against the arguments)."""
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, HfArgumentParser

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    cand, pref, row = CASES[method]
    cand = cand | {"precision": "fp32"}
    plan = _plan(tmp_path, method, cand, pref, row)
    plan = dataclasses.replace(plan, run=dataclasses.replace(plan.run, model_path=str(demo_model)))
    d = json.loads(exports.write_all(plan)["hf_args"].read_text())
    extra = d.pop("_memfit")
    module, name = extra["trl_class"].rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    d = {k: v for k, v in d.items() if k != "deepspeed"} | {"output_dir": str(tmp_path / "out"), "max_steps": 1,
                                                             "warmup_steps": 0, "save_strategy": "no"}  # fmt: skip
    (args,) = HfArgumentParser(cls).parse_dict(_on_this_machine(d) | extra["trl_fields"], allow_extra_keys=False)
    trainer_cls = getattr(importlib.import_module(module), name.replace("Config", "Trainer"))
    peft = LoraConfig(**extra["peft_lora_config"]) if extra["peft_lora_config"] else None
    rows = [row] * 4 if method != "kto" else [row, {**row, "completion": "6", "label": False}] * 2
    Path(plan.data_source).write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_dataset("json", data_files=plan.data_source, split="train")
    tok = AutoTokenizer.from_pretrained(demo_model)
    trainer = trainer_cls(model=str(demo_model), args=args, train_dataset=data, processing_class=tok, peft_config=peft)
    out = trainer.train()
    assert out.global_step == 1 and math.isfinite(out.training_loss)


@pytest.mark.parametrize("method", list(CASES))
def test_the_workflows_selection_exports_the_method_with_the_pairs_it_trains_on(repo, tmp_path, monkeypatch, method):
    """select_config with the shipped config/preference.yaml (orpo, simpo, kto without data.<method>:
    they train on data.dpo's pairs; rm on its own data.rm) writes each method's exports, pointing
    at the pairs the method trains on."""
    from memfit.workflow.pipeline import select_config

    config = yaml.safe_load((repo / "config" / "preference.yaml").read_text()) | {"plan_only": True}
    assert (method in config["data"]) == (method == "rm")
    monkeypatch.chdir(repo)  # data paths are relative to the workflow directory, as Snakemake runs it
    run_dir = tmp_path / method
    out = {k: str(run_dir / f"{k}.{ext}") for k, ext in (("selected", "json"), ("ds_config", "json"),
                                                          ("run", "json"), ("launch", "sh"))}  # fmt: skip
    candidates = repo / "tests/fixtures/select/dpo/candidates.json"
    select_config(config, "demo-tiny", "cpu", method, str(candidates), [], "results/demo-tiny/model",
                  str(tmp_path / "data"), str(run_dir / "train"), out)  # fmt: skip
    files = exports.paths(run_dir, method)
    info = json.loads(files["llamafactory_dataset_info"].read_text())[f"memfit_{method}"]
    y = yaml.safe_load(files["llamafactory"].read_text())
    hf = json.loads(files["hf_args"].read_text())["_memfit"]
    assert y["stage"] == {"rm": "rm", "orpo": "dpo", "simpo": "dpo", "kto": "kto"}[method]
    assert hf["trl_fields"]["max_length"] == y["cutoff_len"]
    source = "data/demo/rm.jsonl" if method == "rm" else "data/demo/dpo.jsonl"
    pairs = str(repo / source)
    if method == "kto":  # pairs: TRL unpairs them itself, LLaMA-Factory needs unpaired rows
        assert info["file_name"] == "" and "#   - KTO from pairs" in files["llamafactory"].read_text()
        assert any("KTOTrainer unpairs them itself" in n for n in hf["notes"])
    else:
        assert info["file_name"] == pairs
    if method == "rm":
        argv = exports.script_argv(files["openrlhf"].read_text())
        assert argv[argv.index("--data.dataset") + 1] == source
