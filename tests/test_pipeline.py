"""The workflow's plan stages without Snakemake: estimate_candidates then select_config (plan only)."""

from __future__ import annotations

import json

import pytest
import yaml

from memfit.train.run_config import RunConfig
from memfit.workflow import pipeline
from memfit.workflow.config import WorkflowConfig


@pytest.fixture()
def cfg(repo, monkeypatch) -> WorkflowConfig:
    monkeypatch.chdir(repo)
    raw = yaml.safe_load((repo / "config/cluster-example.yaml").read_text())
    raw.update(plan_only=True, estimate={"activations": "analytic"})  # no weights here; no tracing
    return WorkflowConfig.load(raw)


def test_plan_for_hardware_not_present(cfg, tmp_path):
    run = tmp_path / "qwen2.5-7b/a100-80gb/sft"
    table = pipeline.estimate_candidates(cfg, "qwen2.5-7b", "a100-80gb", "sft", run / "candidates.json")
    written = json.loads((run / "candidates.json").read_text())
    assert [r["id"] for r in written["rows"]] == [r["id"] for r in table["rows"]]
    assert table["probe"] == []  # plan only: nothing to probe on
    assert table["world_size"] == cfg.world_size == 8
    assert len(table["rows"]) == len(cfg.candidates("sft"))
    assert table["budget"]["device_bytes"] == cfg.budget("a100-80gb").device_bytes

    out = {
        "selected": run / "selected.json",
        "ds_config": run / "ds_config.json",
        "run": run / "run.json",
        "launch": run / "launch.sh",
    }
    # a stage may get the dict Snakemake holds instead of the WorkflowConfig: the same result
    selected = pipeline.select_config(
        dict(cfg.raw),
        "qwen2.5-7b",
        "a100-80gb",
        "sft",
        run / "candidates.json",
        [],
        "/models/qwen",
        "data",
        str(run / "train"),
        out,
    )
    best = selected["selected"]
    assert selected["plan_only"] and best["fits"] and best["source"] == "predicted"
    assert best["device_bytes"] <= cfg.budget("a100-80gb").device_limit_bytes
    assert all(best["tokens_per_s"] >= r["tokens_per_s"] for r in selected["candidates"] if r["fits"])
    rc = RunConfig.load(run / "run.json")
    assert (rc.candidate, rc.model_path, rc.out_dir) == (best["candidate"], "/models/qwen", str(run / "train"))
    ds = json.loads((run / "ds_config.json").read_text())
    c = best["candidate"]
    assert ds["train_micro_batch_size_per_gpu"] == c["micro_batch"]
    assert ds["train_batch_size"] == c["micro_batch"] * c["grad_accum"] * 8 == cfg.raw["train"]["global_batch"]
    assert f"--nproc {cfg.num_gpus}" in (run / "launch.sh").read_text()


# ------------------------------------------------------------------ the demo's probes
def demo_cfg(repo, model_dir, **overrides) -> WorkflowConfig:
    raw = yaml.safe_load((repo / "config/config.yaml").read_text())
    raw["models"] = {"demo-tiny": {"path": str(model_dir)}}
    raw["estimate"] = {"activations": "analytic"}
    raw.update(overrides)
    return WorkflowConfig.load(raw)


def test_a_boundary_probe_checks_the_estimate_where_it_decides(repo, demo_model, tmp_path, monkeypatch):
    """DPO on the demo: the fastest candidates hold micro batch 16 and are predicted just over the
    budget; one of them (the fastest within the margin) is probed as well, so the estimator is
    measured where it rejects a faster candidate."""
    monkeypatch.chdir(repo)
    cfg = demo_cfg(repo, demo_model)
    table = pipeline.estimate_candidates(cfg, "demo-tiny", "cpu", "dpo", tmp_path / "candidates.json")
    by_id = {r["id"]: r for r in table["rows"]}
    limit = cfg.budget("cpu").device_limit_bytes
    (bid,) = table["boundary_probe"]
    b = by_id[bid]
    assert bid in table["probe"] and table["probe"][-1] == bid
    assert not b["fits"] and limit < b["device_total_bytes"] <= 1.2 * limit
    others = [by_id[i] for i in table["probe"] if i != bid]
    assert all(b["tokens_per_s"] > r["tokens_per_s"] for r in others)
    # the fastest of those within the margin
    near = [
        r
        for r in table["rows"]
        if not r["invalid"] and not r["fits"] and limit < r["device_total_bytes"] <= 1.2 * limit
    ]
    assert b["tokens_per_s"] == max(r["tokens_per_s"] for r in near)
    # margin 0: no boundary probe, the rest unchanged
    off = pipeline.estimate_candidates(
        demo_cfg(repo, demo_model, probe={**cfg.raw["probe"], "boundary_margin": 0}),
        "demo-tiny",
        "cpu",
        "dpo",
        tmp_path / "off.json",
    )
    assert off["boundary_probe"] == [] and off["probe"] == table["probe"][:-1]


def test_boundary_probe_rules(repo):
    from memfit.estimate.rows import Budget

    budget = Budget(device_bytes=100, host_bytes=1000, headroom=0.1)  # limit 90

    def row(i, dev, tps, fits=False, invalid=False, host=10):
        return {
            "id": i,
            "device_total_bytes": dev,
            "tokens_per_s": tps,
            "fits": fits,
            "invalid": invalid,
            "host_bytes": host,
        }

    probed = row("p", 80, 100.0, fits=True)
    rows = [
        probed,
        row("too-far", 110, 300.0),  # 22% over the limit
        row("cannot-run", 95, 250.0, invalid=True),
        row("host", 95, 240.0, host=2000),  # over the host RAM: a probe could take the node down
        row("near-fast", 100, 200.0),
        row("near-faster-but-over", 105, 220.0),
        row("near-slow", 92, 90.0),  # would not win even if it fit
    ]
    assert pipeline.boundary_probe(rows, ["p"], budget, 0.2) == ["near-faster-but-over"]
    assert pipeline.boundary_probe(rows, ["p"], budget, 0.15) == ["near-fast"]  # 105 > 90 * 1.15
    assert pipeline.boundary_probe(rows, ["p"], budget, 0.0) == []
    assert pipeline.boundary_probe(rows[:1] + rows[-1:], ["p"], budget, 0.2) == []


def test_select_config_refuses_a_probe_that_failed(repo, demo_model, tmp_path, monkeypatch):
    """A probe JSON with status error (what memfit wrote before such probes stopped the workflow)
    stops selection with the probe's log, not with "no candidate fits"."""
    from memfit.workflow.probe import ProbeFailed

    monkeypatch.chdir(repo)
    cfg = demo_cfg(repo, demo_model)
    run = tmp_path / "demo-tiny/cpu/sft"
    table = pipeline.estimate_candidates(cfg, "demo-tiny", "cpu", "sft", run / "candidates.json")
    cid = table["probe"][0]
    probe = run / "probes" / f"{cid}.json"
    probe.parent.mkdir()
    probe.write_text(
        json.dumps(
            {
                "id": cid,
                "status": "error",
                "error": "exit code 1; see probe.log",
                "log_tail": "Traceback (most recent call last):\n  File \"x\"\nKeyError: 'chosen'",
            }
        )
    )
    out = {k: run / f"{k}.json" for k in ("selected", "ds_config", "run")} | {"launch": run / "launch.sh"}
    with pytest.raises(ProbeFailed, match=rf"(?s){probe}: probe of {cid} failed .*KeyError: 'chosen'"):
        pipeline.select_config(
            cfg,
            "demo-tiny",
            "cpu",
            "sft",
            run / "candidates.json",
            [probe],
            str(demo_model),
            "data",
            str(run / "train"),
            out,
        )
    assert not any(p.exists() for p in out.values())


@pytest.mark.slow
def test_a_probe_that_fails_stops_the_workflow_with_its_error(repo, demo_model, tmp_path, monkeypatch):
    """Real ranks fail for a reason other than memory (the data directory has no train split): the
    probe stage raises with the rank's first error lines and leaves no probe JSON behind."""
    from memfit.workflow.probe import ProbeFailed

    monkeypatch.chdir(repo)
    cfg = demo_cfg(repo, demo_model, probe={"top_k": 1, "steps": 1, "timeout_s": 300})
    run = tmp_path / "demo-tiny/cpu/sft"
    table = pipeline.estimate_candidates(cfg, "demo-tiny", "cpu", "sft", run / "candidates.json")
    cid = table["probe"][0]
    empty = tmp_path / "data"
    empty.mkdir()
    out, log = run / "probes" / f"{cid}.json", tmp_path / "probe.log"
    out.parent.mkdir()
    with pytest.raises(ProbeFailed) as e:
        pipeline.probe_candidate(cfg, "sft", cid, run / "candidates.json", str(demo_model), str(empty), out, log)
    msg = str(e.value)
    assert msg.startswith(f"probe of {cid} failed (exit code 1; see {log}), not for lack of memory or time")
    assert "Traceback (most recent call last)" in msg and "train.parquet" in msg, msg
    assert len(msg.splitlines()) <= 30
    assert not out.exists() and list(out.parent.iterdir()) == []


def test_the_error_shown_is_this_runs_first_traceback(tmp_path):
    """Probe logs are appended to, and both ranks write at once: the excerpt is the first rank's
    traceback of the latest launch, not an older run's and not two ranks' lines interleaved."""
    from memfit.workflow.probe import error_excerpt

    log = tmp_path / "probe.log"
    log.write_text(
        'Traceback (most recent call last):\n  File "old.py"\nOldError: a previous run\n'
        "$ torchrun --nproc-per-node 2 -m memfit.train.loop --config run.json\n"
        "UserWarning: not an error\n"
        "[rank1]: Traceback (most recent call last):\n[rank0]: Traceback (most recent call last):\n"
        '[rank1]:   File "train.py", line 10, in setup\n[rank0]:   File "train.py", line 10, in setup\n'
        "[rank1]:     rows = read(data)\n[rank0]:     rows = read(data)\n"
        "[rank1]: FileNotFoundError: data/train.parquet\n[rank0]: FileNotFoundError: data/train.parquet\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: memfit.train.loop FAILED\n"
    )
    assert error_excerpt(log).splitlines() == [
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "train.py", line 10, in setup',
        "[rank1]:     rows = read(data)",
        "[rank1]: FileNotFoundError: data/train.parquet",
    ]
    # before torch.distributed's excepthook: no rank prefix, the two ranks' lines interleaved
    log.write_text(
        "$ memfit launch --config run.json --nproc 2\n"
        "Traceback (most recent call last):\nTraceback (most recent call last):\n"
        '  File "train.py", line 10, in setup\n  File "train.py", line 10, in setup\n'
        "FileNotFoundError: data/train.parquet\nFileNotFoundError: data/train.parquet\n"
    )
    assert error_excerpt(log).splitlines() == [
        "Traceback (most recent call last):",
        '  File "train.py", line 10, in setup',
        '  File "train.py", line 10, in setup',
        "FileNotFoundError: data/train.parquet",
    ]
