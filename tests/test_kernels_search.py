"""`kernels` as a search lever (issue #45): `search: kernels: [none, liger]` gives plain and liger
candidates (plain ids unchanged), liger candidates where Liger cannot run (no package, no CUDA GPU, a
model type it does not cover) are left out with the reason or refused naming `search.kernels`, a plan
(plan_only) estimates them for its GPUs, and the estimate prices what Liger's kernels save (memory
from liger-kernel's saved tensors, time from its fused ops' memory passes) and says so. None of this
needs liger-kernel or triton installed (the package checks are replaced where a test needs them);
tests/test_liger_memory.py measures the memory terms against Liger's kernels.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import yaml

from memfit.estimate import estimate
from memfit.estimate.cli import main as estimate_main
from memfit.estimate.models import catalog
from memfit.estimate.selection import levers
from memfit.space import Candidate, engine_key, enumerate_space
from memfit.workflow.config import ConfigError, WorkflowConfig, validate_config

NO_PACKAGE = (
    "kernels: liger needs the liger-kernel package (not installed: liger_kernel, triton); "
    "pip install '.[liger]' on a CUDA machine, or set kernels: none"
)


@pytest.fixture()
def config(repo, monkeypatch):
    monkeypatch.chdir(repo)  # config paths are relative to the repository root
    return yaml.safe_load((repo / "config/config.yaml").read_text())


@pytest.fixture()
def liger_runs(monkeypatch):
    """This machine as one with liger-kernel and a CUDA GPU, Liger covering llama."""
    monkeypatch.setattr("memfit.train.liger.runtime_problem", lambda: None)
    monkeypatch.setattr("memfit.train.liger.installed", lambda: True)
    monkeypatch.setattr(
        "memfit.train.liger.model_problem",
        lambda model_type, where: (
            None if model_type == "llama" else f"kernels: liger has no kernels for model type {model_type!r} ({where})"
        ),
    )


def test_search_kernels_gives_liger_and_plain_candidates(config, liger_runs):
    before = WorkflowConfig.load(copy.deepcopy(config))
    config["search"]["kernels"] = ["none", "liger"]
    config["search"]["loss_impl"] = ["full", "chunked"]
    cfg = WorkflowConfig.load(config)
    for method in ("sft", "dpo"):
        cands = cfg.candidates(method)
        plain = [c for c in cands if c.kernels == "none" and c.loss_impl == "full"]
        liger = [c for c in cands if c.kernels == "liger"]
        assert [c.id for c in plain] == [c.id for c in before.candidates(method)]
        # Liger's loss replaces the chunked one: one liger candidate per plain full-loss one
        assert [c.id for c in liger] == [c.id + "-liger" for c in plain]
        assert engine_key(liger[0]) == engine_key(plain[0]) + "|kernels=liger"  # calibrated on its own
        run = cfg.run_config(method, liger[0].to_dict(), "m", "d", "o")
        assert run.kernels == "liger"


def test_liger_is_left_out_for_methods_it_does_not_train(config, liger_runs):
    config["methods"] = ["sft", "rm"]
    config["train"]["rm"] = {}
    config["search"]["kernels"] = ["none", "liger"]
    cfg = WorkflowConfig.load(config)
    assert any(c.kernels == "liger" for c in cfg.candidates("sft"))
    assert not any(c.kernels == "liger" for c in cfg.candidates("rm"))
    config["search"]["kernels"] = ["liger"]
    with pytest.raises(
        ConfigError,
        match=r"search\.kernels \['liger'\]: kernels: liger applies to sft and dpo only, not rm; add none to search\.kernels",
    ):
        validate_config(config)


def test_liger_where_it_cannot_run_is_said_naming_the_key(config, monkeypatch, capsys):
    monkeypatch.setattr("memfit.train.liger.runtime_problem", lambda: NO_PACKAGE)
    only = copy.deepcopy(config)
    only["search"]["kernels"] = ["liger"]
    with pytest.raises(
        ConfigError,
        match=r"search\.kernels \['liger'\]: kernels: liger needs the liger-kernel package .* or add none to search\.kernels",
    ):
        validate_config(only)
    config["search"]["kernels"] = ["none", "liger"]
    validate_config(config)  # the plain candidates stay, and the warning says why the others went
    assert (
        "search.kernels: the liger candidates are left out: kernels: liger needs the liger-kernel package"
        in capsys.readouterr().err
    )
    assert not any(c.kernels == "liger" for c in WorkflowConfig.of(config).candidates("sft"))
    # a plan trains elsewhere: the machine's package and GPU are not asked, the candidates estimated
    monkeypatch.setattr("memfit.train.liger.installed", lambda: False)
    plan = copy.deepcopy(only) | {"gpus": ["h100-80gb"], "plan_only": True}
    assert all(c.kernels == "liger" for c in WorkflowConfig.load(plan).candidates("dpo"))


def test_liger_for_a_model_type_it_does_not_cover_is_refused(config, liger_runs):
    """A plan of a model type Liger does not cover (here, by the stand-in, anything but llama),
    where the package is installed: refused naming the key and the model."""
    config |= {"gpus": ["h100-80gb"], "plan_only": True, "models": {"q": {"arch": "qwen2-7b"}}}
    config["search"]["kernels"] = ["liger"]
    with pytest.raises(
        ConfigError,
        match=r"search\.kernels \['liger'\]: kernels: liger has no kernels for model type 'qwen2' \(models\.q\)",
    ):
        validate_config(config)


def test_the_tie_rule_counts_liger_as_a_lever():
    plain = Candidate(zero=0).to_dict()
    assert levers({**plain, "kernels": "liger"}) == levers(plain) + 1


def test_bad_kernels_values_are_refused():
    with pytest.raises(ValueError, match="kernels must be none or liger, got 'fused'"):
        Candidate(kernels="fused")
    assert [c.loss_impl for c in enumerate_space({"kernels": ["liger"], "loss_impl": ["full", "chunked"]})] == ["full"]


def test_the_estimate_prices_liger_below_transformers_modules_and_says_so():
    """Llama-3.1-8B LoRA SFT, 4096 tokens on an H100: Liger's saved tensors and traffic are less."""
    arch, gpu = catalog.model("llama-3.1-8b"), catalog.gpu("h100-80gb")
    plain = Candidate(zero=0, finetune="lora", grad_ckpt=False, seq_len=4096)
    liger = dataclasses.replace(plain, kernels="liger")
    chunked = dataclasses.replace(plain, loss_impl="chunked")
    a, b, c = (estimate(arch, gpu, 1, 1, "sft", x) for x in (plain, liger, chunked))
    # no [tokens, vocab] logits (as the chunked loss) and less saved per layer (Liger's RMSNorm and SwiGLU)
    assert b.peak_allocated_bytes < c.peak_allocated_bytes < a.peak_allocated_bytes
    # fewer memory passes than transformers' element-wise ops, the head's GEMM once more in the backward
    assert b.step_time_s < a.step_time_s
    assert any(n.startswith("kernels liger: memory priced from Liger-Kernel's saved tensors") for n in b.notes)
    assert not any(n.startswith("kernels liger") for n in a.notes)


def test_memfit_estimate_ranks_kernels_and_refuses_them_for_rm(capsys):
    rc = estimate_main(
        [
            "--model",
            "llama-3.1-8b",
            "--gpu",
            "h100-80gb",
            "--finetune",
            "lora",
            "--kernels",
            "none,liger",
            "--seq-len",
            "2048",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "selected: z0-gc-flash-lora16-mb1-s2048-bf16-liger (--kernels liger)" in out
    rc = estimate_main(["--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--method", "rm", "--kernels", "liger"])
    assert rc == 2
    assert "--kernels: liger applies to sft and dpo only, not rm; use --kernels none" in capsys.readouterr().err


def test_the_calibration_measures_liger_engines_on_their_own():
    """The calibrate rule's plan: a liger candidate's computation is its own engine (built with Liger
    patched in, memfit.train.calibrate._Engine), so its measured time is what the estimate reads."""
    from memfit.space import compute_engine, compute_key
    from memfit.train.calibrate import plan

    plain = Candidate(zero=2, precision="fp32", attn="sdpa", micro_batch=2, seq_len=32, ref=None)
    liger = dataclasses.replace(plain, kernels="liger")
    p = plan({"sft": [plain, liger]})
    engines = {e["cand"].kernels: key for key, e in p["compute"].items()}
    assert engines == {"none": engine_key(compute_engine(plain)), "liger": engine_key(compute_engine(liger))}
    assert compute_key("sft", liger) in p["compute"][engines["liger"]]["shapes"]
    assert set(p["runtime"]) == {engine_key(plain), engine_key(liger)}
