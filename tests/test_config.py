"""A bad workflow config stops before any job starts, naming the key and what is allowed."""

import copy

import pytest
import yaml

from memfit.workflow.config import ConfigError, WorkflowConfig, validate_config


@pytest.fixture()
def config(repo, monkeypatch):
    monkeypatch.chdir(repo)  # config paths are relative to the repository root
    return yaml.safe_load((repo / "config/config.yaml").read_text())


def test_embedded_default_is_valid(config):
    validate_config(config)


def test_cluster_example_is_valid_as_a_plan(repo, monkeypatch):
    monkeypatch.chdir(repo)
    cfg = yaml.safe_load((repo / "config/cluster-example.yaml").read_text())
    cfg["plan_only"] = True  # the /models paths do not exist here
    validate_config(cfg)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda c: c.update(gpus=["a100-81gb"]), r"gpus\[0\]: .*a100-81gb.*allowed: .*a100-80gb"),
        (lambda c: c["search"].update(zero=[0, 4]), r"search\.zero\.1: 4 is not allowed \(allowed: 0, 1, 2, 3\)"),
        (
            lambda c: c.update(methods=["sft", "ppo"]),
            r"methods\.1: 'ppo' is not allowed \(allowed: 'sft', 'dpo', 'rm', 'orpo', 'simpo', 'kto'\)",
        ),
        (lambda c: c.update(num_gpus="two"), r"num_gpus: 'two' is not of type 'integer'"),
        (lambda c: c["train"].update(batch=8), r"train: .*'batch' was unexpected.*allowed keys: .*global_batch"),
        (lambda c: c["data"].update(sft="data/demo/nope.jsonl"), r"data\.sft: data/demo/nope\.jsonl does not exist"),
        (lambda c: c["train"].update(global_batch=30), r"train\.global_batch: .*not a multiple"),
        (
            lambda c: c["models"].update(mine={"path": "/nonexistent/model"}),
            r"models\.mine\.path: '/nonexistent/model' is not a model directory",
        ),
    ],
)
def test_bad_config_names_the_key(config, change, expected):
    bad = copy.deepcopy(config)
    change(bad)
    with pytest.raises(ConfigError, match=expected):
        validate_config(bad)


def test_every_candidate_trains_the_same_global_batch(config):
    for method in ("sft", "dpo"):
        cands = WorkflowConfig.load(config).candidates(method)
        assert cands
        for c in cands:
            assert c.micro_batch * c.grad_accum * config["num_gpus"] == config["train"]["global_batch"]
            assert c.seq_len == config["data"]["max_len"]


def test_numbers_written_as_strings_are_read_as_numbers(config):
    # YAML 1.1 reads 1e-5 (no dot) as a string; snakemake --config passes nested values as strings
    config["train"]["sft"]["lr"] = "1e-5"
    config["train"]["global_batch"] = "32"
    config["search"]["micro_batch"] = ["4", 8, 16]
    validate_config(config)
    assert config["train"]["sft"]["lr"] == 1e-5
    assert config["train"]["global_batch"] == 32 and config["search"]["micro_batch"] == [4, 8, 16]
    config["train"]["sft"]["lr"] = "fast"
    with pytest.raises(ConfigError, match=r"train\.sft\.lr: 'fast' is not of type 'number'"):
        validate_config(config)


def test_booleans_from_snakemake_config_are_read_as_booleans(config):
    # `snakemake --config plan_only=true 'search={...}'` passes `true` and nested values as strings
    from snakemake.cli import parse_config

    config.update(parse_config(["plan_only=true", 'search={"compile": [false, true], "finetune": ["full"]}']))
    assert config["plan_only"] == "true" and config["search"]["compile"] == ["false", "true"]
    validate_config(config)
    assert config["plan_only"] is True and config["search"]["compile"] == [False, True]
    config["plan_only"] = "False"
    validate_config(config)
    assert config["plan_only"] is False
    config["plan_only"] = "yes"  # only true/false: anything else is still refused, naming the key
    with pytest.raises(ConfigError, match=r"plan_only: 'yes' is not of type 'boolean'"):
        validate_config(config)


# --------------------------------------------------------------------------- WorkflowConfig
def test_load_validates_once_and_of_wraps_without_checking_again(config):
    cfg = WorkflowConfig.load(config)
    assert WorkflowConfig.of(cfg) is cfg
    assert WorkflowConfig.of(config).raw is config  # a stage's snakemake.config: already validated
    bad = copy.deepcopy(config)
    bad["num_gpus"] = 0
    with pytest.raises(ConfigError, match=r"num_gpus: 0 is less than the minimum of 1"):
        WorkflowConfig.load(bad)


def test_world_size_and_budgets(config):
    from memfit.estimate.models import catalog
    from memfit.units import GIB, MIB

    config.update(num_gpus=4, num_nodes=2, cpu_memory_mib=96, host_memory_gib=16, headroom=0.1)
    cfg = WorkflowConfig.load(config)
    assert cfg.world_size == 8
    cpu = cfg.budget("cpu")
    assert (cpu.device_bytes, cpu.host_bytes, cpu.headroom) == (96 * MIB, 16 * GIB, 0.1)
    assert cpu.device_limit_bytes == int(96 * MIB * 0.9)
    a100 = catalog.gpu("a100-80gb")
    assert cfg.budget("a100-80gb").device_bytes == a100.memory_bytes
    config["host_memory_gib"] = None  # the catalog's typical node
    assert cfg.budget("a100-80gb").host_bytes == int(a100.typical_host_memory_gb * 1e9 / GIB * GIB)


def test_model_paths_have_one_home(config, tmp_path):
    cfg = WorkflowConfig.load(config)
    assert cfg.model_path("demo-tiny") == "resources/demo-tiny"
    assert cfg.model_inputs("demo-tiny") == ["resources/demo-tiny"]  # built by the workflow
    assert cfg.policy_path("demo-tiny", "cpu", "sft") == "resources/demo-tiny"
    # DPO trains from the SFT output when the workflow trains SFT too, else from the base model
    assert cfg.policy_path("demo-tiny", "cpu", "dpo") == "results/demo-tiny/cpu/sft/train/model"
    assert cfg.policy_inputs("demo-tiny", "cpu", "dpo") == ["results/demo-tiny/cpu/sft/train/summary.json"]
    only_dpo = WorkflowConfig({**config, "methods": ["dpo"]})
    assert only_dpo.policy_path("demo-tiny", "cpu", "dpo") == "resources/demo-tiny"
    assert only_dpo.policy_inputs("demo-tiny", "cpu", "dpo") == ["resources/demo-tiny"]


def test_architecture_comes_from_weights_then_arch_then_the_catalog(config, tmp_path):
    weights = tmp_path / "m"
    weights.mkdir()
    models = {
        "a": {"path": str(weights), "arch": "qwen2.5-7b"},
        "qwen2.5-7b": {"path": None},
        "b": {"path": "/nonexistent", "arch": "llama-3.1-8b"},
    }
    cfg = WorkflowConfig({**config, "models": models, "plan_only": True})
    assert cfg.arch_source("a") == "qwen2.5-7b"  # no config.json yet
    (weights / "config.json").write_text("{}")
    assert cfg.arch_source("a") == str(weights)
    assert cfg.arch_source("b") == "llama-3.1-8b" and cfg.arch_source("qwen2.5-7b") == "qwen2.5-7b"
    # a plan-only model without weights is no input of any job
    assert cfg.model_inputs("b") == [] and cfg.will_have_weights("a") and not cfg.will_have_weights("b")


def test_run_config_takes_the_train_section_and_the_methods(config, tmp_path):
    cfg = WorkflowConfig.load(config)
    cand = cfg.candidates("dpo")[0].to_dict()
    run = cfg.run_config("dpo", cand, "policy", "data", str(tmp_path))
    t = config["train"]
    assert (run.method, run.model_path, run.ref_model_path, run.candidate) == ("dpo", "policy", "policy", cand)
    assert run.dpo == {k: t["dpo"][k] for k in ("beta", "loss_type", "label_smoothing")}
    assert (run.lr, run.seed, run.save_every, run.export_format) == (
        t["dpo"]["lr"],
        t["seed"],
        t["save_every"],
        "merged",
    )
    assert cfg.run_config("sft", cfg.candidates("sft")[0].to_dict(), "m", "d", "o").ref_model_path is None


def test_a_local_mixture_of_experts_model_is_accepted(config, tmp_path):
    """The estimator models experts (tests/test_estimate_moe.py): a local Mixtral directory
    passes the config check instead of being refused as an MoE at load time."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    d = tmp_path / "tiny-mixtral"
    torch.manual_seed(0)
    MixtralForCausalLM(
        MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                      num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256)
    ).save_pretrained(d, safe_serialization=True)  # fmt: skip
    (d / "tokenizer_config.json").write_text("{}")
    cfg = {**config, "models": {"tiny-mixtral": {"path": str(d)}}}
    validate_config(cfg)
    assert WorkflowConfig.load(cfg).arch_source("tiny-mixtral") == str(d)  # its own config.json


@pytest.mark.parametrize(
    ("method", "finetune", "lr"),
    [("sft", "full", 1e-5), ("sft", "lora", 1e-4), ("sft", "qlora", 1e-4),
     ("dpo", "full", 5e-7), ("dpo", "lora", 5e-6), ("dpo", "qlora", 5e-6)],
)  # fmt: skip
def test_a_config_without_lr_trains_at_the_default_for_its_method_and_finetune(config, tmp_path, method, finetune, lr):
    """Leaving train.<method>.lr out must not train a 7B at a diverging rate: run.json (what the
    ranks, the exports and run.resolved.json read) holds the cited per-method default, and the
    run's log line says it is memfit's default and which key changes it."""
    from memfit.train.run_config import RunConfig

    no_lr = copy.deepcopy(config)
    del no_lr["train"][method]["lr"]
    no_lr["search"]["finetune"] = [finetune]
    cfg = WorkflowConfig.load(no_lr)
    cand = cfg.candidates(method)[0].to_dict()
    run = cfg.run_config(method, cand, "policy", "data", str(tmp_path))
    run.save(tmp_path / "run.json")
    again = RunConfig.load(tmp_path / "run.json")
    assert (again.lr, again.lr_source) == (lr, "default")
    assert again.describe_lr() == (
        f"learning rate {lr:g} (memfit's default for {finetune} {method}; set train.{method}.lr to change it)"
    )
    # a given lr is kept as given, and said to be the config's
    with_lr = WorkflowConfig.load(copy.deepcopy(config)).run_config(method, cand, "p", "d", str(tmp_path))
    assert (with_lr.lr, with_lr.lr_source) == (config["train"][method]["lr"], "config")
    assert with_lr.describe_lr() == f"learning rate {with_lr.lr:g} (train.{method}.lr)"


def test_the_documented_lr_defaults_are_the_ones_applied(repo):
    """docs/config.md (rendered from the schema's description) states the same numbers as DEFAULT_LR."""
    from memfit.train.run_config import DEFAULT_LR

    schema = yaml.safe_load((repo / "workflow/schemas/config.schema.yaml").read_text())
    text = schema["definitions"]["train_common"]["properties"]["lr"]["description"]
    for method in ("sft", "dpo", "rm", "orpo", "simpo", "kto"):
        full, lora = DEFAULT_LR[(method, "full")], DEFAULT_LR[(method, "lora")]
        assert DEFAULT_LR[(method, "qlora")] == lora
        assert f"{method} full {full:g}" in text and f"{method} lora/qlora {lora:g}" in text


def test_num_gpus_counts_gpus_per_node(repo, monkeypatch):
    """A cluster config asking for 32 GPUs in num_gpus (the whole job) is refused before any job,
    naming the split into nodes, as `memfit estimate --num-gpus 32` is."""
    monkeypatch.chdir(repo)
    cfg = yaml.safe_load((repo / "config/cluster-example.yaml").read_text())
    cfg.update(plan_only=True, num_gpus=32)
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    assert (
        "num_gpus: 32 is more than one node holds (at most 16, NVIDIA DGX-2/HGX-2); num_gpus counts GPUs "
        "per node: for 32 GPUs write num_gpus: 8 and num_nodes: 4"
    ) in str(info.value)
    validate_config(cfg | {"num_gpus": 8, "num_nodes": 4})


def test_num_gpus_beyond_the_detected_gpus_is_refused(config, monkeypatch):
    """`gpus: [detect]` is this machine: 2 ranks on its one GPU cannot start; a plan may ask for more."""
    from memfit.estimate.models import detect

    monkeypatch.setattr(detect, "smi_devices", lambda: [("NVIDIA A100-SXM4-80GB", 81920)])
    cfg = copy.deepcopy(config) | {"gpus": ["detect"], "num_gpus": 2, "headroom": 0.1}
    with pytest.raises(
        ConfigError,
        match=r"num_gpus: 2 but this machine has 1 a100-80gb \(gpus: \[detect\], nvidia-smi\); set num_gpus: 1",
    ):
        validate_config(cfg)


@pytest.mark.parametrize("name", ["../elsewhere", "My Run", "a/b"])
def test_a_run_name_must_be_a_folder_name(config, name):
    bad = copy.deepcopy(config) | {"run": name}
    with pytest.raises(ConfigError, match=r"run: .* does not match"):
        validate_config(bad)


def test_a_named_run_lives_under_its_own_folders(config):
    cfg = WorkflowConfig.load(copy.deepcopy(config) | {"run": "qlora"})
    assert (cfg.results_dir, cfg.logs_dir, cfg.benchmarks_dir) == ("results/qlora", "logs/qlora", "benchmarks/qlora")
    assert cfg.run_dir("demo-tiny", "cpu", "sft") == "results/qlora/demo-tiny/cpu/sft"
    assert cfg.policy_path("demo-tiny", "cpu", "dpo") == "results/qlora/demo-tiny/cpu/sft/train/model"
    assert cfg.calibration_inputs("demo-tiny", "cpu") == ["results/qlora/demo-tiny/cpu/calibration.json"]
    default = WorkflowConfig.load(copy.deepcopy(config))
    assert (default.results_dir, default.run_dir("m", "g", "sft")) == ("results", "results/m/g/sft")


def _check_config(cfg: dict, path, capsys) -> tuple[int, str, str]:
    from memfit import cli

    path.write_text(yaml.safe_dump(cfg))
    code = cli.main(["check-config", str(path)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_learning_rate_far_from_its_kind_warns_naming_key_value_and_range(config, tmp_path, capsys):
    """A full SFT at 1e-3 (100x the cited 1e-5) or DPO at 1e-3 (2,000x Zephyr's 5e-7): check-config
    still passes (exit 0, a warning is no error) but says, per method, which key, value and range."""
    cfg = copy.deepcopy(config)
    for method, lr in (("sft", 1e-3), ("dpo", 1e-3)):
        cfg["train"][method]["lr"] = lr
        cfg["train"][method].pop("lr_check", None)
    cfg["search"]["finetune"] = ["full"]
    code, out, err = _check_config(cfg, tmp_path / "hot.yaml", capsys)
    assert code == 0 and out.strip().endswith("valid")
    lines = err.strip().splitlines()
    assert len(lines) == 2, err
    assert "train.sft.lr 0.001 is outside the usual range 1e-06..0.0001 for full sft" in lines[0]
    assert "train.dpo.lr 0.001 is outside the usual range 5e-08..5e-06 for full dpo" in lines[1]
    assert all("may diverge" in line and "lr_check: false" in line for line in lines)
    # a rate 100x below the LoRA default is as suspicious: it barely trains
    cfg["search"]["finetune"] = ["lora"]
    cfg["train"]["sft"]["lr"] = 1e-6
    cfg["train"]["dpo"]["lr"] = 5e-6  # LoRA DPO's own default: no warning
    code, _, err = _check_config(cfg, tmp_path / "cold.yaml", capsys)
    assert code == 0
    assert err.strip().splitlines() == [
        f"memfit check-config: {tmp_path / 'cold.yaml'}: warning: train.sft.lr 1e-06 is outside the usual range "
        "1e-05..0.001 for lora sft (10x either side of memfit's cited default 0.0001) and may barely move "
        "the weights; set train.sft.lr_check: false if it is meant"
    ]


def test_the_demo_configs_say_their_large_rates_are_meant_and_do_not_warn(repo, monkeypatch, capsys):
    """The demo configs train tiny random-init models at rates far above a pretrained model's range;
    they set train.<method>.lr_check: false, so neither check-config nor a run warns on every run."""
    from memfit import cli

    monkeypatch.chdir(repo)
    for name in ("config.yaml", "flagship-tiny.yaml", "gpu-demo.yaml", "preference.yaml"):
        raw = yaml.safe_load((repo / "config" / name).read_text())
        assert all(raw["train"][m]["lr_check"] is False for m in raw["methods"]), name
        if name != "gpu-demo.yaml":  # gpus: [detect] needs an NVIDIA GPU to validate
            assert cli.main(["check-config", f"config/{name}"]) == 0
            assert "warning" not in capsys.readouterr().err, name


def test_the_run_log_line_carries_the_lr_warning_unless_lr_check_is_false(config, tmp_path):
    """The train log's learning-rate line (RunConfig.describe_lr, logged by rank 0) holds the same
    warning; a default lr never warns, and lr_check: false silences a given one."""
    cfg = copy.deepcopy(config)
    cfg["train"]["sft"].pop("lr_check")
    loaded = WorkflowConfig.load(cfg)
    cand = loaded.candidates("sft")[0].to_dict()
    run = loaded.run_config("sft", cand, "p", "d", str(tmp_path))
    assert run.describe_lr() == (
        "learning rate 0.003 (train.sft.lr); warning: train.sft.lr 0.003 is outside the usual range "
        "1e-06..0.0001 for full sft (10x either side of memfit's cited default 1e-05) and may diverge; "
        "set train.sft.lr_check: false if it is meant"
    )
    assert "\n" not in run.describe_lr()
    quiet = WorkflowConfig.load(copy.deepcopy(config)).run_config("sft", cand, "p", "d", str(tmp_path))
    assert quiet.lr_check is False and "warning" not in quiet.describe_lr()
    del cfg["train"]["sft"]["lr"]
    default = WorkflowConfig.load(cfg).run_config("sft", cand, "p", "d", str(tmp_path))
    assert "warning" not in default.describe_lr()


def test_the_lr_warning_is_per_finetune_and_per_method_and_lr_check_must_be_a_boolean(config, tmp_path, capsys):
    """search.finetune [full, lora] at train.sft.lr 1e-3: wrong for full (10x-100x its 1e-5), the
    top of LoRA's range; prepare_data asks for its own method's lines only. A non-boolean lr_check
    is refused by check-config (exit 2) naming the key."""
    from memfit.workflow.check_config import lr_warnings

    cfg = copy.deepcopy(config)
    cfg["search"]["finetune"] = ["full", "lora"]
    cfg["train"]["sft"].update(lr=1e-3, lr_check=True)
    cfg["train"]["dpo"].update(lr=1e-3, lr_check=True)
    loaded = WorkflowConfig.load(cfg)
    sft = lr_warnings(loaded, ["sft"])
    assert len(sft) == 1 and "for full sft" in sft[0]
    assert [w.split(" is outside")[0] for w in lr_warnings(loaded)] == [
        "warning: train.sft.lr 0.001",
        "warning: train.dpo.lr 0.001",
        "warning: train.dpo.lr 0.001",
    ]
    cfg["train"]["sft"]["lr_check"] = "maybe"
    code, out, err = _check_config(cfg, tmp_path / "bad.yaml", capsys)
    assert code == 2 and out == ""
    assert "train.sft.lr_check: 'maybe' is not of type 'boolean'" in err and "Traceback" not in err


@pytest.fixture()
def preference(repo, monkeypatch):
    monkeypatch.chdir(repo)
    return yaml.safe_load((repo / "config/preference.yaml").read_text())


def test_the_preference_methods_train_on_the_dpo_pairs_from_the_sft_output(preference, tmp_path):
    """rm, orpo, simpo and kto read data.dpo unless data.<method> is given (the demo's rm has its own), start from the SFT
    output, and carry their TRL-named hyperparameters into run.json; only kto holds a reference."""
    cfg = WorkflowConfig.load(preference)
    assert cfg.methods == ["sft", "rm", "orpo", "simpo", "kto"]
    assert cfg.data_source("rm") == "data/demo/rm.jsonl" and cfg.data_key("rm") == "data.rm"
    for m in ("rm", "orpo", "simpo", "kto"):
        if m != "rm":
            assert cfg.data_source(m) == "data/demo/dpo.jsonl" and cfg.data_key(m) == "data.dpo"
        assert cfg.policy_path("demo-tiny", "cpu", m) == "results/preference/demo-tiny/cpu/sft/train/model"
    own = copy.deepcopy(preference)
    own["data"]["kto"] = "data/demo/dpo.jsonl"
    assert WorkflowConfig.load(own).data_key("kto") == "data.kto"
    for m in ("rm", "orpo", "simpo"):  # no reference: no ref-<mode> in the ids, no reference path
        assert all(c.ref is None and "ref-" not in c.id for c in cfg.candidates(m))
        assert cfg.run_config(m, cfg.candidates(m)[0].to_dict(), "base", str(tmp_path), "o").ref_model_path is None
    kto = cfg.candidates("kto")
    assert kto and all(c.ref == "model" and c.micro_batch >= 2 for c in kto)
    run = cfg.run_config("kto", kto[0].to_dict(), "base", str(tmp_path), "o")
    assert run.ref_model_path == "base" and run.dpo == {}
    assert run.pref == {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0}
    simpo = cfg.run_config("simpo", cfg.candidates("simpo")[0].to_dict(), "base", str(tmp_path), "o")
    assert simpo.pref == {"beta": 2.0, "simpo_gamma": 0.5}


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            lambda c: c["train"]["orpo"].update(loss_type="ipo"),
            r"train\.orpo\.loss_type: a hyperparameter of dpo, not of orpo \(orpo takes beta\)",
        ),
        (
            lambda c: c["train"]["rm"].update(simpo_gamma=1.0),
            r"train\.rm\.simpo_gamma: a hyperparameter of simpo, not of rm \(rm takes center_rewards_coefficient\)",
        ),
        (lambda c: c["train"]["simpo"].update(label_smoothing=0.5), r"train\.simpo: simpo label_smoothing must be in"),
        (
            lambda c: c["search"].update(micro_batch=[1]),
            r"search\.micro_batch: kto needs 2 or more rows per micro batch",
        ),
        (lambda c: c["data"].pop("dpo"), r"data\.dpo: missing \(methods lists orpo \(or data\.orpo\)\)"),
        (lambda c: c["train"].pop("kto"), r"train\.kto: missing \(methods lists kto\)"),
    ],
)
def test_a_bad_preference_config_names_the_key(preference, change, expected):
    bad = copy.deepcopy(preference)
    change(bad)
    with pytest.raises(ConfigError, match=expected):
        validate_config(bad)


def test_a_search_that_adds_an_engine_changes_what_the_calibration_measures(config):
    """The calibrate rule's params (memfit.workflow.config.calibration_engines): Snakemake reruns
    the calibration when they change, so a newly searched lever's engine is measured, not priced
    by the uncalibrated model beside calibrated ones."""
    plain = WorkflowConfig.load(copy.deepcopy(config)).calibration_engines()
    config["search"]["compile"] = [False, True]
    both = WorkflowConfig.load(config).calibration_engines()
    assert not any("compile=True" in e for e in plain)
    assert set(plain) < set(both) and any("compile=True" in e for e in both)
    config["train"]["dpo"] = {**(config["train"].get("dpo") or {}), "lr": 2e-4}  # a training setting
    assert WorkflowConfig.load(config).calibration_engines() == both  # measures nothing new
