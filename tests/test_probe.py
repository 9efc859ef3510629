"""memfit.workflow.probe: running out of memory is a result, not a crash.

`run_probe` turns how the ranks ended into one JSON result. The ranks are replaced by a
function standing in for `memfit.train.launch.launch` that ends as the trainer does (markers and
exit codes of `memfit.train.rank.run_rank`); one slow test launches real ranks that refuse a
candidate this machine cannot run. The measured probe itself is in test_train.py (slow).
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from memfit.space import Candidate
from memfit.train.run_config import OOM_EXIT_CODE, RunConfig
from memfit.units import MIB
from memfit.workflow import probe

PREDICTION = {
    "id": "x",
    "peak_allocated_bytes": 123,
    "peak_reserved_bytes": 456,
    "host_bytes": 7,
    "step_time_s": 0.5,
    "breakdown": {"not": "copied"},
}


def run_config(tmp_path: Path, **cand) -> RunConfig:
    c = Candidate(zero=2, micro_batch=4, seq_len=32, **cand)
    return RunConfig(
        method="sft",
        model_path=str(tmp_path / "model"),
        data_dir=str(tmp_path / "data"),
        out_dir=str(tmp_path / "train"),
        candidate=c.to_dict(),
    )


def ranks_that(monkeypatch, end):
    """Replace the launched ranks: `end(run, cfg_path)` writes what the ranks would and returns the exit code."""
    calls = []

    def fake_launch(cfg_path, nproc, log=None, timeout_s=None, nnodes=1):
        run = json.loads(Path(cfg_path).read_text())
        calls.append({"run": run, "nproc": nproc, "timeout_s": timeout_s, "nnodes": nnodes})
        return end(Path(run["out_dir"]), log)

    monkeypatch.setattr(probe, "launch", fake_launch)
    return calls


def test_a_cuda_oom_on_one_rank_is_recorded_as_oom(tmp_path, monkeypatch):
    def oom(out, _log):  # what run_rank does on torch.OutOfMemoryError
        (out / "oom.rank1.json").write_text(
            json.dumps({"rank": 1, "error": "CUDA out of memory. Tried to allocate 2.00 GiB"})
        )
        return OOM_EXIT_CODE

    calls = ranks_that(monkeypatch, oom)
    out = tmp_path / "probes" / "x.json"
    out.parent.mkdir()
    res = probe.run_probe(run_config(tmp_path), nproc=2, out_json=out, steps=3, timeout_s=60, prediction=PREDICTION)
    assert res["status"] == "oom" and "Tried to allocate 2.00 GiB" in res["error"]
    assert json.loads(out.read_text()) == res
    assert res["predicted"] == {
        k: PREDICTION[k] for k in ("peak_allocated_bytes", "peak_reserved_bytes", "host_bytes", "step_time_s")
    }
    # the probe ran in probe mode, without checkpoints or export, in a scratch directory it removed
    run = calls[0]["run"]
    assert (run["probe_steps"], run["save_every"], run["export"], run["resume"]) == (3, 0, False, "never")
    assert calls[0]["nproc"] == 2 and calls[0]["timeout_s"] == 60
    assert not Path(run["out_dir"]).exists()
    assert sorted(p.name for p in out.parent.iterdir()) == ["x.json"]


@pytest.mark.parametrize("rc", [-signal.SIGKILL, 128 + signal.SIGKILL])
def test_a_rank_killed_by_the_kernel_is_a_host_oom(tmp_path, monkeypatch, rc):
    ranks_that(monkeypatch, lambda _out, _log: rc)
    res = probe.run_probe(run_config(tmp_path), nproc=2, out_json=tmp_path / "p.json")
    assert res["status"] == "oom" and "host out of memory" in res["error"]


def test_a_finished_probe_reports_rank0s_measurement(tmp_path, monkeypatch):
    def ok(out, _log):
        (out / "probe.rank0.json").write_text(json.dumps({"peak_allocated_bytes": 1000, "step_time_s": 0.25}))
        return 0

    ranks_that(monkeypatch, ok)
    cfg = run_config(tmp_path)
    res = probe.run_probe(cfg, nproc=2, out_json=tmp_path / "p.json", steps=2)
    assert res == {
        "id": cfg.cand.id,
        "candidate": cfg.candidate,
        "world_size": 2,
        "steps": 2,
        "status": "ok",
        "peak_allocated_bytes": 1000,
        "step_time_s": 0.25,
    }


def test_a_timeout_and_a_crash_are_results_too(tmp_path, monkeypatch):
    def too_slow(_out, _log):
        raise subprocess.TimeoutExpired("torchrun", 5)

    ranks_that(monkeypatch, too_slow)
    res = probe.run_probe(run_config(tmp_path), nproc=2, out_json=tmp_path / "p.json", timeout_s=5)
    assert res["status"] == "timeout" and "within 5 s" in res["error"]
    # no rank summary: the device the launcher ran the ranks on (#41), as the selection checks it
    assert res["device_name"] == ("cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name())

    def crash(_out, log):
        Path(log).write_text("line\n" * 50 + "ValueError: bad data\n")
        return 1

    ranks_that(monkeypatch, crash)
    log = tmp_path / "probe.log"
    res = probe.run_probe(run_config(tmp_path), nproc=2, out_json=tmp_path / "p.json", log=log)
    assert res["status"] == "error" and "exit code 1" in res["error"]
    assert res["log_tail"].endswith("ValueError: bad data") and len(res["log_tail"].splitlines()) == 40


@pytest.mark.slow
def test_real_ranks_that_refuse_the_candidate_give_an_error_result(tmp_path):
    """Real torchrun ranks: attn=flash cannot run on this machine; the probe says so instead of raising."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA (flash attention is refused on the CPU)")
    log = tmp_path / "probe.log"
    res = probe.run_probe(
        run_config(tmp_path, attn="flash"), nproc=2, out_json=tmp_path / "p.json", log=log, steps=1, timeout_s=300
    )
    assert res["status"] == "error", res
    assert res["error"] == f"exit code 1; see {log}" and res["log_tail"]
    assert "RuntimeError: attn=flash needs a CUDA GPU" in log.read_text()  # the rank's reason, in the log named


@pytest.mark.slow
def test_real_ranks_over_the_cpu_capacity_oom_with_phase_and_bytes(tmp_path, demo_model, demo_data):
    """Real torchrun ranks on the cpu device: under a capacity the step cannot fit, the tracker raises
    torch.OutOfMemoryError, the trainer's OOM handler writes its marker, and the probe records where."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the cpu capacity applies without CUDA")
    c = Candidate(zero=0, micro_batch=16, seq_len=32)
    cap = 44 * MIB  # weights, Adam states and data (about 40 MiB, the baseline) fit; a micro batch of 16 does not
    run = RunConfig(
        method="sft",
        model_path=str(demo_model),
        data_dir=str(demo_data / "sft"),
        out_dir=str(tmp_path / "train"),
        candidate=c.to_dict(),
        max_steps=3,
        device_capacity_bytes=cap,
    )
    log = tmp_path / "probe.log"
    res = probe.run_probe(run, nproc=2, out_json=tmp_path / "p.json", log=log, steps=1, timeout_s=300)
    assert res["status"] == "oom", (res, log.read_text()[-3000:])
    assert res["oom"]["phase"] in ("forward", "backward", "optimizer step"), res
    assert res["oom"]["capacity_bytes"] == cap and res["oom"]["live_bytes"] > cap
    assert "CPU device capacity exceeded" in res["error"]
