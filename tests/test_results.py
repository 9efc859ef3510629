"""memfit.results: every candidate of every run as one pandas DataFrame a user slices in a notebook."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from test_report import OOM, WINNER, _dpo_run, _write
from test_report_curves import SMALL, _with_fallback

from memfit import results
from memfit.space import Candidate

FIXTURES = Path(__file__).parent / "fixtures" / "select"


def _tree(tmp_path: Path) -> Path:
    """results/ with three runs: the report's trained DPO run (an OOM fallback, a failed resume
    check), the selection fixtures' probed DPO and SFT runs (candidates.json, probes/, selected.json)."""
    _with_fallback(tmp_path)
    for method in ("dpo", "sft"):
        run = tmp_path / "results" / "demo-tiny" / "a100-80gb" / method
        shutil.copytree(FIXTURES / method, run)
        sel = json.loads((FIXTURES / f"{method}.selected.expected.json").read_text())
        _write(run / "selected.json", sel | {"gpu": "a100-80gb"})
    return tmp_path / "results"


def _runs(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.glob("*/*/*/selected.json"))


@pytest.fixture
def tree(tmp_path) -> Path:
    return _tree(tmp_path)


def test_one_row_per_candidate_with_every_lever_and_figure(tree):
    df = results.load(tree)
    for run in _runs(tree):
        sel = json.loads((run / "selected.json").read_text())
        mine = df[(df.gpu == sel["gpu"]) & (df.method == sel["method"])]
        assert sorted(mine.id) == sorted(c["id"] for c in sel["candidates"])
        assert list(mine["rank"]) == list(range(1, len(mine) + 1))  # selected.json's ranking
    levers = [f for f in Candidate().to_dict()]
    for col in ["model", "gpu", "method", "id", *levers, "predicted_device_total_bytes", "predicted_host_bytes",
                "predicted_step_time_s", "fits", "source", "probe_status", "probe_peak_allocated_bytes",
                "probe_step_time_s", "selected", "trained", "resume_check"]:  # fmt: skip
        assert col in df.columns, col
    # the probed fixtures' estimates carry phases: the device and host peak of each phase is a column
    phases = [c for c in df.columns if c.startswith("predicted_phase_")]
    host_phases = [c for c in df.columns if c.startswith("predicted_host_phase_")]
    assert "predicted_phase_forward_bytes" in phases and host_phases
    probed = df[(df.gpu == "a100-80gb") & df.probed]
    assert probed[phases].notna().any(axis=1).all()


def test_selected_row_is_what_selected_json_says(tree):
    df = results.load(tree)
    for run in _runs(tree):
        sel = json.loads((run / "selected.json").read_text())
        chosen = sel["selected"]
        row = df[(df.gpu == sel["gpu"]) & (df.method == sel["method"]) & df.selected]
        assert len(row) == 1
        row = row.iloc[0]
        assert row["id"] == chosen["id"] and row["rank"] == 1
        for k, v in chosen["candidate"].items():
            # a lever the method has not (SFT's DPO reference: None) is a missing value in the table
            assert pd.isna(row[k]) if v is None else row[k] == v, k
        assert row["device_bytes"] == chosen["device_bytes"]
        assert row["tokens_per_s"] == pytest.approx(chosen["tokens_per_s"])
        assert row["source"] == chosen["source"] and bool(row["fits"]) is chosen["fits"]
        assert row["predicted_device_total_bytes"] == chosen["predicted"]["device_total_bytes"]
        probe = chosen.get("probe") or {}
        assert row["probe_peak_allocated_bytes"] == probe.get("peak_allocated_bytes")


def test_fastest_fitting_measured_candidate_per_gpu_and_method_is_the_selection(tree):
    df = results.load(tree)
    # the README's lines: what memfit.estimate.selection chose, asked of the table
    fit = df[df.fits & (df.source == "measured")]
    best = df.loc[fit.groupby(["model", "gpu", "method"]).tokens_per_s.idxmax()]
    chosen = {(r.gpu, r.method): r.id for r in best.itertuples()}
    expected = {}
    for run in _runs(tree):
        sel = json.loads((run / "selected.json").read_text())
        expected[(sel["gpu"], sel["method"])] = sel["selected"]["id"]
    assert chosen == expected and len(expected) == 3
    assert set(best.id) == set(df[df.selected].id)


def test_training_fallback_and_resume_verdict(tree):
    df = results.load(tree).set_index(["gpu", "method", "id"])
    assert df.loc[("cpu", "dpo", WINNER), "trained"] and df.loc[("cpu", "dpo", SMALL), "trained"]
    assert not df.loc[("cpu", "dpo", OOM), "trained"]
    # the resume check belongs to the candidate the training finished on (after the OOM fallback)
    assert df.loc[("cpu", "dpo", SMALL), "resume_check"] == "failed"
    assert pd.isna(df.loc[("cpu", "dpo", WINNER), "resume_check"])
    oom = df.loc[("cpu", "dpo", OOM)]
    assert oom["probe_status"] == "oom" and oom["source"] == "probe" and not oom["fits"]
    assert not df.loc[("a100-80gb", "sft")].trained.any()  # selected, never trained


def test_before_selection_rows_come_from_candidates_json_and_probes(tmp_path):
    run = tmp_path / "results" / "demo-tiny" / "cpu" / "dpo"
    shutil.copytree(FIXTURES / "dpo", run)
    df = results.load(tmp_path / "results")
    table = json.loads((run / "candidates.json").read_text())
    assert list(df.id) == [r["id"] for r in table["rows"]]
    assert df["rank"].isna().all() and not df.selected.any()
    probes = {p.stem: json.loads(p.read_text())["status"] for p in (run / "probes").glob("*.json")}
    assert dict(zip(df[df.probed].id, df[df.probed].probe_status, strict=True)) == probes


def test_parquet_round_trip_keeps_the_table(tree, tmp_path):
    out = results.write_parquet([p / "selected.json" for p in _runs(tree)], tmp_path / "candidates.parquet")
    back = pd.read_parquet(out)
    pd.testing.assert_frame_equal(back, results.load(tree))
    assert back["rank"].dtype == "Int64" and back.selected.dtype == bool


def test_a_malformed_file_is_named(tmp_path):
    paths = _dpo_run(tmp_path)
    paths["selected"].write_text('{"model": "demo-tiny"')
    with pytest.raises(results.ResultsError, match=r"selected\.json: cannot read selection"):
        results.load(tmp_path / "results")
    with pytest.raises(results.ResultsError, match="no run"):
        results.load(tmp_path / "nothing")
