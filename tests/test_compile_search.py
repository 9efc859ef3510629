"""`compile` as a search lever (issue #45): `search: compile: [false, true]` gives compiled and eager
candidates, a machine that cannot compile for the `cpu` device is said naming the key, and the
estimate prices the compiled layers as eager (memory not yet measured against inductor's layers)
unless a calibration of the compiled engine gives its time.
"""

from __future__ import annotations

import copy

import pytest
import yaml

from memfit.estimate import estimate
from memfit.estimate.models import catalog
from memfit.space import Candidate, engine_key
from memfit.workflow.config import ConfigError, WorkflowConfig, validate_config

NO_CXX = "compile: true needs a C++ compiler for torch inductor's CPU backend (none of $CXX, c++, g++, clang++ is on the PATH)"


@pytest.fixture()
def config(repo, monkeypatch):
    monkeypatch.chdir(repo)  # config paths are relative to the repository root
    return yaml.safe_load((repo / "config/config.yaml").read_text())


def test_search_compile_gives_compiled_and_eager_candidates(config, monkeypatch):
    monkeypatch.setattr("memfit.train.compile.compile_problem", lambda: None)
    before = WorkflowConfig.load(copy.deepcopy(config))
    config["search"]["compile"] = [False, True]
    cfg = WorkflowConfig.load(config)
    for method in ("sft", "dpo"):
        cands = cfg.candidates(method)
        eager = [c for c in cands if not c.compile]
        compiled = [c for c in cands if c.compile]
        assert [c.id for c in eager] == [c.id for c in before.candidates(method)]
        assert [c.id for c in compiled] == [c.id + "-compiled" for c in eager]
        # another engine (its layers compiled): the calibrate rule measures it on its own
        assert engine_key(compiled[0]) == engine_key(eager[0]) + "|compile=True"
        assert cfg.run_config(method, compiled[0].to_dict(), "m", "d", "o").compile


def test_compile_where_the_cpu_cannot_compile_is_said_naming_the_key(config, monkeypatch, capsys):
    monkeypatch.setattr("memfit.train.compile.compile_problem", lambda: NO_CXX)
    only = copy.deepcopy(config)
    only["search"]["compile"] = [True]
    with pytest.raises(ConfigError, match=r"search\.compile \[True\] with gpus \[cpu\]: compile: true needs a C\+\+"):
        validate_config(only)
    config["search"]["compile"] = [False, True]
    validate_config(config)  # the eager candidates stay, and the warning says why the others went
    assert "search.compile: the compiled candidates are left out on gpus [cpu]" in capsys.readouterr().err
    assert not any(c.compile for c in WorkflowConfig.of(config).candidates("sft"))
    plan = copy.deepcopy(only) | {"gpus": ["h100-80gb"], "plan_only": True}  # CUDA compiles with Triton
    assert all(c.compile for c in WorkflowConfig.load(plan).candidates("sft"))


def test_the_estimate_prices_compiled_layers_as_eager_and_says_so():
    arch, gpu = catalog.model("llama-3.1-8b"), catalog.gpu("h100-80gb")
    eager = Candidate(zero=0, finetune="lora", grad_ckpt=True)
    compiled = Candidate(zero=0, finetune="lora", grad_ckpt=True, compile=True)
    a, b = estimate(arch, gpu, 1, 1, "sft", eager), estimate(arch, gpu, 1, 1, "sft", compiled)
    assert (b.peak_allocated_bytes, b.device_total_bytes, b.step_time_s) == (
        a.peak_allocated_bytes,
        a.device_total_bytes,
        a.step_time_s,
    )
    assert any(n.startswith("compile: memory priced as the eager layers") for n in b.notes), b.notes
