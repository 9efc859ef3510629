"""'Did training work': the report's training curves with eval points, resumes, OOM fallbacks and
the resume check marked, and the page's list of what switched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_report import WINNER, GiB, MiB, _cand, _dpo_run, _pred, _render, _text, _write

from memfit.report.charts import curves_figure
from memfit.report.inputs import read_inputs
from memfit.report.marks import training_marks

SMALL = "z2-nogc-sdpa-full-mb2-s32-fp32-ref-model"  # half the micro batch, twice the accumulation


def _with_fallback(tmp_path: Path) -> dict:
    """The trained DPO fixture after a crash resumed at step 2 and an OOM at step 6 that fell back
    from the selected candidate to SMALL, resuming from the checkpoint at step 4."""
    paths = _dpo_run(tmp_path)
    sel = json.loads(paths["selected"].read_text())
    sel["candidates"].insert(1, {
        "id": SMALL, "candidate": _cand(2, 2, 8), "predicted": _pred(120 * MiB, 150 * MiB, 0.6),
        "source": "measured", "fits": True, "reason": "slower than the selected candidate",
        "probe": {"status": "ok", "peak_allocated_bytes": 130 * MiB, "peak_reserved_bytes": None, "step_time_s": 0.6},
    })  # fmt: skip
    _write(paths["selected"], sel)
    metrics_path = paths["summary"].parent / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    for r in rows:
        if r["split"] == "train" and r["step"] == 3:
            r["resumed_from_step"] = 2  # what memfit.train.loop writes on the first row after a resume
        if r["split"] == "train" and r["step"] == 5:
            r["resumed_from_step"] = 4  # the fallback's relaunch resumed too
    _write(metrics_path, "".join(json.dumps(r) + "\n" for r in rows))
    summary = json.loads(paths["summary"].read_text())
    summary["fallbacks"] = [{
        "oom_step": 6, "resumed_from_step": 4, "from": WINNER, "to": SMALL, "phase": "backward",
        "op": "aten::mm", "bytes_live": int(3.2 * GiB), "capacity_bytes": 3 * GiB,
    }]  # fmt: skip
    _write(paths["summary"], summary)
    return paths


def _run(paths: dict):
    inputs = read_inputs([paths["selected"]], [paths["summary"]], [paths["resume"]], [])
    return inputs.runs[0]


def test_marks_say_where_the_run_resumed_fell_back_and_was_checked(tmp_path):
    run = _run(_with_fallback(tmp_path))
    marks = [(m.step, m.kind, m.short) for m in training_marks(run)]
    assert marks == [
        (2, "resume", "resumed from 2"),
        (4, "fallback", "fallback 1: resumed from 4"),
        (4, "resume-check", "resume check from 4"),
        (6, "oom", "OOM 1 at step 6"),
    ]  # the fallback's own relaunch (resumed_from_step 4 on step 5) is not a second resume mark


def test_curves_draw_every_logged_metric_with_eval_points_and_labelled_marks(tmp_path):
    run = _run(_with_fallback(tmp_path))
    marks = training_marks(run)
    fig = curves_figure(run.metrics, run.title, marks)
    titles = [ax.get_title() for ax in fig.axes]
    for want in ("loss", "reward accuracy", "reward margin", "rewards (DPO", "learning rate", "gradient norm",
                 "throughput, rank 0", "device memory", "host RSS", "policy log-prob"):  # fmt: skip
        assert any(t.startswith(want) for t in titles), f"no {want!r} panel in {titles}"
    loss = fig.axes[0]
    # eval points: dots at the eval steps (4 and 8), beside the training line
    ev = next(line for line in loss.get_lines() if line.get_label() == "eval")
    assert list(ev.get_xdata()) == [4, 8] and ev.get_marker() == "o"
    # labels on the chart: every mark's short label on the first panel, shared where steps coincide
    labels = [t.get_text() for t in loss.texts]
    assert "resumed from 2" in labels and "OOM 1 at step 6" in labels
    assert "fallback 1: resumed from 4\nresume check from 4" in labels
    # and the lines on every panel, at the marks' steps
    for ax in fig.axes:
        xs = {
            line.get_xdata()[0]
            for line in ax.get_lines()
            if len(set(line.get_xdata())) == 1 and len(line.get_xdata()) == 2
        }
        assert {2, 4, 6} <= xs, f"{ax.get_title()}: vertical marks at {xs}"
    # units where there are units
    mem = next(ax for ax in fig.axes if ax.get_title().startswith("device memory"))
    assert mem.get_ylabel() == "MiB"
    assert next(ax for ax in fig.axes if ax.get_title().startswith("throughput")).get_ylabel() == "tok/s"


def test_sft_curves_have_no_dpo_panels():
    rows = [{"step": s, "split": "train", "loss": 2.0 / s, "lr": 1e-4 * s, "tokens_per_s": 900.0} for s in range(1, 6)]
    titles = [ax.get_title() for ax in curves_figure(rows, "sft", []).axes]
    assert titles == ["loss", "learning rate", "throughput, rank 0 (non-padding tokens/s)"]


def test_page_lists_the_switch_and_the_marks(tmp_path):
    paths = _with_fallback(tmp_path)
    page = _render(tmp_path, paths)
    text = _text(page)
    assert "Training ran out of memory 1 time(s) and continued on another configuration" in text
    assert f"It finished on {SMALL}" in text
    # the switch: where, what, how much, from what to what, and which levers changed
    assert f"6 backward aten::mm 3.20 GiB of 3.00 GiB {WINNER} 4 {SMALL} micro_batch 4 → 2, grad_accum 4 → 8" in text
    assert f"trained; 1 OOM fallback(s), finished on {SMALL}" in text  # the overview says it too
    # the marks, in words, and named in the chart's alt text
    assert "training resumed from its checkpoint at step 2" in text
    assert f"resumed from the checkpoint at step 4 on {SMALL} (steps 5-6 run again)" in text
    assert "out of memory at step 6 (backward, aten::mm, 3.20 GiB live of a 3.00 GiB capacity)" in text
    assert "resume check: a copy of the finished run restarted from the checkpoint at step 4" in text
    assert 'alt="training curves, demo-tiny · cpu · dpo; marked: resumed from 2, fallback 1: resumed from 4' in page


def test_no_fallbacks_no_banner_and_a_malformed_entry_is_a_note(tmp_path):
    paths = _dpo_run(tmp_path)
    text = _text(_render(tmp_path, paths))
    assert "Training ran out of memory" not in text and "OOM fallback(s)" not in text
    summary = json.loads(paths["summary"].read_text())
    summary["fallbacks"] = [{"oom_step": "six", "from": WINNER}]
    _write(paths["summary"], summary)
    text = _text(_render(tmp_path, paths))
    assert "fallbacks[0] lacks oom_step, resumed_from_step, to; not shown" in text


def test_an_older_summary_still_marks_its_resume(tmp_path):
    """No row carries resumed_from_step, but the summary says its launch resumed and ran 5 of 8 steps."""
    paths = _dpo_run(tmp_path)
    summary = json.loads(paths["summary"].read_text()) | {
        "steps": 5,
        "resume_peak_allocated_bytes": 60 * MiB,
    }
    _write(paths["summary"], summary)
    marks = training_marks(_run(paths))
    assert [(m.step, m.kind) for m in marks] == [(3, "resume"), (4, "resume-check")]
    assert "from summary.json" in marks[0].label
    # what loading the checkpoint cost is shown beside the training peaks
    summary["resume_host_rss_bytes"] = 700 * MiB
    _write(paths["summary"], summary)
    text = _text(_render(tmp_path, paths))
    assert "device peak while loading the checkpoint 60.0 MiB" in text
    assert "host RSS after loading the checkpoint, largest rank 700.0 MiB" in text


@pytest.mark.slow
def test_a_real_resumed_training_is_marked_where_it_resumed(shared_runs, tmp_path):
    """memfit's trainer, "killed" after step 4 and relaunched (it resumes from the checkpoint at
    step 3; the session's shared run, tests/deepspeed_runs.py): the report's curves mark the
    resume at step 3 and draw what the trainer logged."""
    out, rows = shared_runs["sft-z3-resumed"]
    assert [r.get("resumed_from_step") for r in rows if r["split"] == "train"] == [
        None,
        None,
        None,
        3,
        None,
        None,
    ]
    paths = _dpo_run(tmp_path / "page")  # a selection to hang the real training outputs on
    train_dir = paths["summary"].parent
    for name in ("metrics.jsonl", "summary.json"):
        shutil.copyfile(out / name, train_dir / name)
    run = _run(paths)
    assert [(m.step, m.kind) for m in training_marks(run)] == [(3, "resume"), (4, "resume-check")]
    titles = [ax.get_title() for ax in curves_figure(run.metrics, run.title, training_marks(run)).axes]
    assert titles[0] == "loss" and {"learning rate", "gradient norm (global)", "throughput, rank 0 (non-padding tokens/s)",
                                    "device memory: running peak, largest rank", "host RSS: peak, largest rank"} <= set(titles)  # fmt: skip
    text = _text(_render(tmp_path / "page", paths))
    assert (
        "training resumed from its checkpoint at step 3 (a relaunch after a crash or preemption; from metrics.jsonl)"
        in text
    )


def test_a_reward_models_curves_show_its_pair_accuracy_and_margin_not_dpo_panels():
    """rm logs TRL RewardTrainer's `accuracy` and `margin`: their panels, and no empty DPO reward panels."""
    rows = [
        {"step": s, "split": split, "loss": 0.7 - 0.02 * s, "accuracy": 0.5 + 0.03 * s, "margin": 0.1 * s}
        for s in range(1, 9)
        for split in (("train", "eval") if s % 4 == 0 else ("train",))
    ]
    titles = [ax.get_title() for ax in curves_figure(rows, "demo-tiny / cpu / rm").axes]
    assert any(t.startswith("reward model: pair accuracy") for t in titles), titles
    assert any(t.startswith("reward model: score margin") for t in titles), titles
    assert not any(t.startswith(("rewards (", "reward accuracy")) for t in titles), titles
