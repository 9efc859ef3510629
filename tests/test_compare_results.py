"""`memfit compare-results`: two results trees that decided and trained the same, or every difference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from memfit.cli import main as cli
from memfit.workflow.compare_results import compare_trees

RUN = "demo-tiny/cpu/sft"


def write_tree(
    root: Path,
    *,
    selected="z2-mb8",
    losses=(2.5, 2.0, 1.5),
    passed=True,
    probe_status="ok",
    calibrated=False,
    step_scale=1.0,
    decision=None,
) -> Path:
    """A results tree as the workflow writes it, reduced to what the comparison reads (plus noise)."""
    run = root / RUN
    (run / "probes").mkdir(parents=True)
    (run / "train").mkdir()
    rows = [
        {
            "id": cid,
            "fits": True,
            "invalid": False,
            "peak_allocated_bytes": 1000 + i,
            "peak_reserved_bytes": 1000 + i,
            "device_total_bytes": 1000 + i,
            "host_bytes": 5000,
            "step_time_s": 0.1 * (i + 1) * step_scale,
            "time_source": "measured 2026-11-27 on cpu, 2 ranks x 1 threads (gloo)" if calibrated else "assumed",
            "breakdown": {"x": i},
        }
        for i, cid in enumerate(("z2-mb8", "z3-mb4"))
    ]
    (run / "candidates.json").write_text(json.dumps({"probe": ["z2-mb8", "z3-mb4"], "rows": rows}))
    for cid in ("z2-mb8", "z3-mb4"):
        status = probe_status if cid == "z3-mb4" else "ok"
        (run / "probes" / f"{cid}.json").write_text(json.dumps({"id": cid, "status": status, "step_time_s": 0.3}))
    ranked = [
        {"id": cid, "tokens_per_s": 1000.0 + (cid == selected), "source": "measured"} for cid in ("z2-mb8", "z3-mb4")
    ]
    chosen = {"id": selected} | ({"decision": decision} if decision else {})
    (run / "selected.json").write_text(json.dumps({"selected": chosen, "candidates": ranked}))
    metrics = [
        {"step": s + 1, "split": "train", "loss": loss, "tokens_per_s": 99.0 + s} for s, loss in enumerate(losses)
    ]
    metrics.append({"step": len(losses), "split": "eval", "loss": losses[-1] + 0.1})
    (run / "train" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    verdict = {
        "passed": passed,
        "from_step": 1,
        "final_step": 3,
        "steps_compared": 2,
        "missing_steps": [],
        "losses_bitwise_equal": passed,
        "weights_bitwise_equal": passed,
        "resume_peak_allocated_bytes": 7,
    }
    (run / "verify_resume.json").write_text(json.dumps(verdict))
    return root


def test_identical_trees_are_the_same_and_timings_do_not_count(tmp_path):
    a = write_tree(tmp_path / "a")
    b = write_tree(tmp_path / "b")
    # measured speed and memory vary between two runs of the same code: not compared
    probe = b / RUN / "probes" / "z2-mb8.json"
    probe.write_text(json.dumps({"id": "z2-mb8", "status": "ok", "step_time_s": 9.9}))
    assert compare_trees(a, b) == []
    assert cli(["compare-results", str(a), str(b)]) == 0


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"selected": "z3-mb4"}, f"{RUN}/selected.json: selected: 'z2-mb8' != 'z3-mb4'"),
        ({"losses": (2.5, 2.0, 1.4)}, f"{RUN}/train/metrics.jsonl: step 3 train loss: 1.5 != 1.4"),
        ({"passed": False}, f"{RUN}/verify_resume.json: passed: True != False"),
        ({"probe_status": "oom"}, f"{RUN}/probes: z3-mb4 status: 'ok' != 'oom'"),
    ],
)
def test_each_difference_is_named_and_exits_1(tmp_path, capsys, change, expected):
    a = write_tree(tmp_path / "a")
    b = write_tree(tmp_path / "b", **change)
    diffs = compare_trees(a, b)
    assert expected in diffs, diffs
    assert cli(["compare-results", str(a), str(b)]) == 1
    assert expected in capsys.readouterr().out


def test_a_different_selection_shows_both_candidates_speeds(tmp_path):
    diffs = compare_trees(write_tree(tmp_path / "a"), write_tree(tmp_path / "b", selected="z3-mb4"))
    assert diffs[-1] == (
        f"{RUN}/selected.json: tokens/s (first tree: z2-mb8 1001 (measured), z3-mb4 1000 (measured); "
        "second tree: z2-mb8 1000 (measured), z3-mb4 1001 (measured))"
    )


def test_a_missing_step_or_run_is_a_difference(tmp_path):
    a = write_tree(tmp_path / "a")
    b = write_tree(tmp_path / "b", losses=(2.5, 2.0))
    diffs = compare_trees(a, b)
    assert f"{RUN}/train/metrics.jsonl: step 3 train loss only in the first tree (1.5)" in diffs
    shutil.rmtree(b / RUN)
    assert compare_trees(a, b) == [f"{RUN}: only in {a}"]


def test_prediction_changes_are_caught_and_rtol_forgives_float_noise(tmp_path):
    a = write_tree(tmp_path / "a")
    b = write_tree(tmp_path / "b", losses=(2.5, 2.0, 1.5 * (1 + 1e-9)))
    table = json.loads((b / RUN / "candidates.json").read_text())
    table["rows"][1]["device_total_bytes"] += 1
    (b / RUN / "candidates.json").write_text(json.dumps(table))
    diffs = compare_trees(a, b, rtol=1e-6)
    assert diffs == [f"{RUN}/candidates.json: z3-mb4.device_total_bytes: 1001 != 1002"]  # ints stay exact
    assert len(compare_trees(a, b)) == 3  # rtol 0: the last train and eval losses differ too


def test_a_file_without_the_compared_key_names_file_and_key(tmp_path):
    a = write_tree(tmp_path / "a")
    b = write_tree(tmp_path / "b")
    (b / RUN / "selected.json").write_text(json.dumps({"chosen": {}}))
    with pytest.raises(ValueError, match=r"selected\.json: no key 'selected'"):
        compare_trees(a, b)


def test_empty_trees_are_not_silently_the_same(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert compare_trees(tmp_path / "a", tmp_path / "b") != []
    with pytest.raises(FileNotFoundError, match="not a directory"):
        compare_trees(tmp_path / "a", tmp_path / "nope")


SPEED = {"by": "speed", "runner_up": "z3-mb4", "margin": 0.4, "noise": 0.15, "tied": []}
TIE = {"by": "tie rule", "runner_up": "z3-mb4", "margin": -0.05, "noise": 0.15, "tied": ["z2-mb8", "z3-mb4"]}


def test_calibrated_step_times_are_reported_with_their_spread_never_a_difference(tmp_path, capsys):
    """Issue #41: tests/slurm/run.sh failed on candidates.json step_time_s 0.458 vs 0.422 s."""
    a = write_tree(tmp_path / "a", calibrated=True)
    b = write_tree(tmp_path / "b", calibrated=True, step_scale=1.09)
    assert compare_trees(a, b) == []
    assert cli(["compare-results", str(a), str(b)]) == 0
    out = capsys.readouterr()
    assert f"timing: {RUN}/candidates.json: 2 of 2 calibrated step times differ, median +9.0%" in out.out
    assert "measured timing(s) reported, not compared" in out.err
    # a modelled step time is a prediction: it must be equal
    modelled = compare_trees(write_tree(tmp_path / "m1"), write_tree(tmp_path / "m2", step_scale=1.09))
    assert modelled[0].startswith(f"{RUN}/candidates.json: z2-mb8.step_time_s: 0.1 != 0.109"), modelled


def test_a_selection_within_the_noise_is_reported_and_one_beyond_it_is_a_difference(tmp_path, capsys):
    a = write_tree(tmp_path / "a", decision=SPEED)
    # the second run's margin was within its noise, so the tie rule decided: not a difference, and
    # the two trainings (of different candidates) are not compared
    b = write_tree(tmp_path / "b", selected="z3-mb4", decision=TIE, losses=(2.6, 2.1, 1.6))
    assert compare_trees(a, b) == []
    assert cli(["compare-results", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert f"timing: {RUN}/selected.json: selected: 'z2-mb8' != 'z3-mb4' within the measured noise" in out
    assert "second tree by tie rule, margin -5.0% over z3-mb4, noise 15%" in out
    assert f"timing: {RUN}/train: not compared: the runs trained different candidates" in out
    # both beyond the noise: the same inputs must select the same
    c = write_tree(tmp_path / "c", selected="z3-mb4", decision=SPEED | {"runner_up": "z2-mb8"})
    assert f"{RUN}/selected.json: selected: 'z2-mb8' != 'z3-mb4'" in compare_trees(a, c)
    assert cli(["compare-results", str(a), str(c)]) == 1


def test_trained_weights_must_be_equal_within_rtol(tmp_path):
    import torch
    from safetensors.torch import save_file

    a, b = write_tree(tmp_path / "a"), write_tree(tmp_path / "b")
    w = torch.linspace(-1, 1, 12).reshape(3, 4)
    for root, t in ((a, w), (b, w + 1e-7)):
        (root / RUN / "train" / "model").mkdir()
        save_file({"lm_head.weight": t}, str(root / RUN / "train" / "model" / "model.safetensors"))
    diffs = compare_trees(a, b)
    assert len(diffs) == 1 and diffs[0].startswith(
        f"{RUN}/train/model/model.safetensors: lm_head.weight: max |difference| 1.19e-07"
    ), diffs
    assert compare_trees(a, b, rtol=1e-5) == []


@pytest.mark.parametrize("bad", ["missing", "file"])
def test_a_missing_folder_exits_2_naming_it(tmp_path, capsys, bad):
    a = write_tree(tmp_path / "a")
    other = tmp_path / "nope"
    if bad == "file":
        other.write_text("x")
    assert cli(["compare-results", str(a), str(other)]) == 2
    err = capsys.readouterr().err
    what = "does not exist" if bad == "missing" else "is not a folder"
    assert (
        err.startswith(f"memfit compare-results: {other} {what}: give two results/ folders") and "Traceback" not in err
    )


def test_a_broken_file_exits_2_naming_it(tmp_path, capsys):
    a, b = write_tree(tmp_path / "a"), write_tree(tmp_path / "b")
    (b / RUN / "verify_resume.json").write_text("{")
    assert cli(["compare-results", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert f"{b / RUN / 'verify_resume.json'}: not JSON" in err and "Traceback" not in err


@pytest.mark.parametrize("rtol", ["-1", "nan", "inf"])
def test_a_bad_rtol_exits_2_naming_the_flag(tmp_path, capsys, rtol):
    a, b = write_tree(tmp_path / "a"), write_tree(tmp_path / "b")
    assert cli(["compare-results", str(a), str(b), "--rtol", rtol]) == 2
    assert "must be a finite number >= 0" in capsys.readouterr().err
