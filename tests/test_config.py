"""A bad workflow config stops before any job starts, naming the key and what is allowed."""

import copy

import pytest
import yaml

from memfit.config import ConfigError, WorkflowConfig, validate_config


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
        (lambda c: c.update(methods=["sft", "ppo"]), r"methods\.1: 'ppo' is not allowed \(allowed: 'sft', 'dpo'\)"),
        (lambda c: c.update(num_gpus="two"), r"num_gpus: 'two' is not of type 'integer'"),
        (lambda c: c["train"].update(batch=8), r"train: .*'batch' was unexpected.*allowed keys: .*global_batch"),
        (lambda c: c["data"].update(sft="data/demo/nope.jsonl"), r"data\.sft: data/demo/nope\.jsonl does not exist"),
        (lambda c: c["train"].update(global_batch=30), r"train\.global_batch: .*not a multiple"),
        (lambda c: c["models"].update(mine={"path": "/nonexistent/model"}), r"models\.mine\.path: '/nonexistent/model' is not a model directory"),
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
