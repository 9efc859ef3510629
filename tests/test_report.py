"""memfit.report: the HTML page a user opens after a run (or a plan) — what it must say and show."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest

from memfit import __version__, report

GiB = 2**30
MiB = 2**20
WINNER = "z2-nogc-sdpa-full-mb4-s32-fp32-ref-model"
OOM = "z0-nogc-sdpa-full-mb16-s32-fp32-ref-model"
HOSTILE = 'exit code 1; see <script>alert("x")</script> & more'


def _cand(zero: int, mb: int, ga: int) -> dict:
    return {
        "zero": zero, "offload_optimizer": "none", "offload_param": "none", "pin_memory": False,
        "offload_ratio": 1.0, "grad_ckpt": False, "attn": "sdpa", "finetune": "full", "lora_rank": 16,
        "micro_batch": mb, "seq_len": 32, "grad_accum": ga, "precision": "fp32", "ref": "model",
    }  # fmt: skip


def _pred(alloc: int, total: int, step: float) -> dict:
    return {
        "peak_allocated_bytes": alloc, "peak_reserved_bytes": alloc, "device_total_bytes": total,
        "host_bytes": 3 * GiB, "step_time_s": step, "fits": True,
    }  # fmt: skip


def _write(path: Path, obj) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


def _dpo_run(root: Path, *, plan_only: bool = False, reason: str = "probe oom: CPU out of memory") -> dict:
    """A DPO run on `cpu` with two candidates: the winner, and one whose probe ran out of memory."""
    run = root / "results" / "demo-tiny" / "cpu" / "dpo"
    winner = {
        "id": WINNER, "candidate": _cand(2, 4, 4), "predicted": _pred(150 * MiB, 180 * MiB, 0.42),
        "source": "predicted" if plan_only else "measured", "fits": True,
        "reason": "selected: fastest that fits", "device_bytes": 160 * MiB, "host_bytes": 2 * GiB,
        "step_time_s": 0.5, "tokens_per_s": 4096.0,
    }  # fmt: skip
    loser = {
        "id": OOM, "candidate": _cand(0, 16, 1), "predicted": _pred(900 * MiB, 1 * GiB, 0.3),
        "source": "probe", "fits": False, "reason": reason,
    }  # fmt: skip
    if not plan_only:
        winner["probe"] = {
            "status": "ok", "peak_allocated_bytes": 160 * MiB, "peak_reserved_bytes": None,
            "host_rss_bytes_node": 2 * GiB, "step_time_s": 0.5, "first_step_time_s": 1.4,
            "device": "cpu", "memory_source": "AllocationTracker (live tensor storages)",
        }  # fmt: skip
        loser["probe"] = {"status": "oom", "peak_allocated_bytes": None, "peak_reserved_bytes": None, "error": reason}
    selected = {
        "model": "demo-tiny", "gpu": "cpu", "method": "dpo", "selected": winner,
        "budget": {"device_bytes": 4 * GiB, "host_bytes": 16 * GiB, "headroom": 0.1},
        "plan_only": plan_only, "launch": "memfit launch --config results/demo-tiny/cpu/dpo/run.json --nproc 2",
        "candidates": [winner, loser],
    }  # fmt: skip
    breakdown = {"params": 20 * MiB, "grads": 20 * MiB, "optimizer": 80 * MiB, "activations": 30 * MiB,
                 "logits": 10 * MiB, "reference": 20 * MiB, "temporaries": 5 * MiB, "overheads": 0}  # fmt: skip
    table = {"world_size": 2, "budget": selected["budget"], "estimator": "memfit.estimate (activations traced)", "rows": [
        {"id": WINNER, "candidate": winner["candidate"], "breakdown": breakdown, "notes": ["fp32 on the CPU"]},
        {"id": OOM, "candidate": loser["candidate"], "breakdown": {k: 4 * v for k, v in breakdown.items()}},
    ]}  # fmt: skip
    paths = {"selected": _write(run / "selected.json", selected)}
    _write(run / "candidates.json", table)
    if plan_only:
        return paths
    metrics = []
    for step in range(1, 9):
        metrics.append({
            "step": step, "split": "train", "loss": 0.69 - 0.03 * step, "lr": 1e-4, "grad_norm": 1.0,
            "tokens_per_s": 4000.0 + step, "step_time_s": 0.5, "peak_allocated_bytes": 158 * MiB,
            "peak_reserved_bytes": None, "host_rss_bytes": GiB, "rewards/chosen": 0.01 * step,
            "rewards/rejected": -0.01 * step, "rewards/accuracies": 0.5 + 0.05 * step,
            "rewards/margins": 0.02 * step, "logps/chosen": -10.0, "logps/rejected": -12.0,
        })  # fmt: skip
        if step % 4 == 0:
            metrics.append({"step": step, "split": "eval", "loss": 0.7 - 0.02 * step,
                            "rewards/accuracies": 0.5 + 0.04 * step, "rewards/margins": 0.015 * step})  # fmt: skip
    _write(run / "train" / "metrics.jsonl", "".join(json.dumps(m) + "\n" for m in metrics))
    paths["summary"] = _write(run / "train" / "summary.json", {
        "world_size": 2, "steps": 8, "peak_allocated_bytes": 158 * MiB, "peak_reserved_bytes": None,
        "host_rss_bytes_max_rank": GiB, "host_rss_bytes_node": 2 * GiB, "first_step_time_s": 1.3,
        "step_time_s": 0.5, "device": "cpu", "memory_source": "AllocationTracker (live tensor storages)",
    })  # fmt: skip
    paths["resume"] = _write(run / "verify_resume.json", {
        "from_step": 4, "final_step": 8, "steps_compared": 4, "missing_steps": [],
        "max_rel_loss_diff": 0.031, "losses_bitwise_equal": False, "weights_max_abs_diff": 0.002,
        "weights_bitwise_equal": False, "passed": False,
        "resumed_from": "results/demo-tiny/cpu/dpo/train/checkpoints/step00000004", "rtol": 1e-5,
        "training_peak_allocated_bytes": 40 * 2**20, "resume_peak_allocated_bytes": 50 * 2**20,
        "resume_host_rss_bytes": 2 * 2**30, "training_host_rss_bytes": 3 * 2**30,
    })  # fmt: skip
    paths["data"] = _write(root / "results" / "demo-tiny" / "data" / "dpo" / "stats.json", {
        "method": "dpo", "source": "data/demo/dpo.jsonl", "max_len": 32, "rows_read": 1000,
        "rows_kept": {"train": 940, "eval": 50}, "dropped": {"blank": 2, "prompt_too_long": 8},
        "truncated": {"chosen": 31, "rejected": 12},
        "length": {"min": 9, "mean": 17.5, "p50": 17, "p90": 24, "p99": 31, "max": 32},
        "worst_case_rows": [3, 7], "tokens": 34000,
    })  # fmt: skip
    return paths


def _render(tmp_path: Path, paths: dict) -> str:
    out = tmp_path / "results" / "report.html"
    report.write_report(
        selected=[str(paths["selected"])],
        summaries=[str(paths["summary"])] if "summary" in paths else [],
        resume=[str(paths["resume"])] if "resume" in paths else [],
        data_stats=[str(paths["data"])] if "data" in paths else [],
        out_html=str(out),
    )
    return out.read_text()


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("report")
    return _render(tmp, _dpo_run(tmp, reason=HOSTILE))


def _text(page: str) -> str:
    """The page's visible text, roughly: tags dropped, whitespace collapsed."""
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page)))


def test_page_is_one_self_contained_file(page):
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", page, re.I)
    assert not re.search(r"<(script|link|iframe)\b", page, re.I)
    assert "<style>" in page


def test_names_what_ran_and_the_selected_candidate(page):
    text = _text(page)
    assert "demo-tiny" in text and "cpu" in text and "dpo" in text and __version__ in text
    # the selected configuration in words, and how to launch it
    assert "ZeRO-2" in text and "micro batch 4 × grad accum 4 × 2 ranks = 32 rows per step" in text
    assert "seq len 32 tokens" in text and "fp32" in text and "frozen reference model" in text
    assert "memfit launch --config results/demo-tiny/cpu/dpo/run.json --nproc 2" in text
    # the selection table highlights the winner
    row = re.search(r'<tr class="selected">(.*?)</tr>', page, re.S)
    assert row and WINNER in row.group(1)


def test_every_loser_has_its_reason_escaped(page):
    row = next(r for r in re.findall(r"<tr>(.*?)</tr>", page, re.S) if OOM in r)
    assert "probe oom" in row and "OOM" in row
    assert "0.300 s (predicted)" in row  # its own figures died with the probe: the prediction, marked
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; more" in row
    assert "<script>" not in page


def test_plots_are_embedded_images(page):
    images = re.findall(r'<img class="plot" alt="([^"]*)" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    alts = [alt for alt, _ in images]
    for what in (
        "memory per candidate",
        "predicted memory breakdown",
        "training curves",
        "training peak vs probe peak",
        "length distribution",
    ):
        assert any(a.startswith(what) for a in alts), f"no {what!r} plot in {alts}"
    assert all(data.startswith("iVBORw0KGgo") for _, data in images)  # the PNG signature


def test_failed_resume_check_is_said_plainly(page):
    text = _text(page)
    assert "Resume check did NOT pass" in text
    assert "max relative loss difference 0.031 > tolerance 1e-05" in text
    assert re.search(r"resume check</th>.*?<td class=\"bad\">FAILED</td>", page, re.S | re.I)
    # the memory of loading the checkpoint, beside the training peak
    assert "device peak while loading the checkpoint" in text and "50.0 MiB (1.25x the training peak)" in text


def test_training_memory_and_data_figures_with_units(page):
    text = _text(page)
    assert "158.0 MiB" in text and "160.0 MiB" in text  # training and probe peak
    assert "0.99× the probe" in text
    assert "1,000" in text and "prompt_too_long" in text and "chosen" in text  # rows read, dropped, truncated
    assert "4,005 tok/s" in text or "4,004 tok/s" in text
    assert "4.00 GiB per device, 10% headroom kept free: 3.60 GiB usable" in text
    assert "Predicted by memfit.estimate (activations traced)" in text
    # what a preference run is for, held out: the last evaluation's reward accuracy (0.5 + 0.04 x 8)
    assert "held-out reward accuracy 0.820 at step 8 (chance 0.5)" in text


def test_dpo_reference_modes_measured_side_by_side(tmp_path):
    """The twin probe estimate_candidates adds: what `ref: precomputed` saved over `ref: model`."""
    paths = _dpo_run(tmp_path)
    pre = "z2-nogc-sdpa-full-mb4-s32-fp32-ref-precomputed"
    sel = json.loads(paths["selected"].read_text())
    sel["candidates"].append({
        "id": pre, "candidate": _cand(2, 4, 4) | {"ref": "precomputed"}, "predicted": _pred(100 * MiB, 110 * MiB, 0.4),
        "source": "measured", "fits": True, "reason": "slower than the selected candidate",
        "probe": {"status": "ok", "peak_allocated_bytes": 120 * MiB, "peak_reserved_bytes": None, "step_time_s": 0.45},
    })  # fmt: skip
    _write(paths["selected"], sel)
    table_path = paths["selected"].parent / "candidates.json"
    table = json.loads(table_path.read_text()) | {"reference_compare": {"precomputed": pre, "model": WINNER}}
    _write(table_path, table)
    page = _render(tmp_path, paths)
    text = _text(page)
    assert "DPO reference: what keeping no reference model saves" in text
    assert "ref: precomputed peaked at 120.0 MiB per device, ref: model at 160.0 MiB: 40.0 MiB (25%) less" in text
    assert 'alt="dpo reference: precomputed vs model' in page
    # a twin whose probe failed is said plainly, not compared
    sel["candidates"][-1]["probe"] = {"status": "timeout", "peak_allocated_bytes": None}
    _write(paths["selected"], sel)
    text = _text(_render(tmp_path, paths))
    assert "The comparison is incomplete" in text and "timeout" in text


def test_plan_only_run_without_training_or_resume(tmp_path):
    page = _render(tmp_path, _dpo_run(tmp_path, plan_only=True))
    text = _text(page)
    assert "Plan only" in text and "the data was not prepared" in text
    # no training sections at all: the plan is the whole story
    assert "Did training work" not in text and "Resume check" not in text and "training curves" not in page
    assert "resume check" not in text  # nor the overview's training and resume columns
    assert WINNER in text and "What hardware fits" in text
    assert 'alt="memory per candidate' in page


def test_malformed_input_raises_naming_the_file_and_leaves_no_page(tmp_path):
    paths = _dpo_run(tmp_path)
    out = tmp_path / "results" / "report.html"
    out.write_text("previous report")
    paths["resume"].write_text('{"passed": tru')  # half-written JSON
    with pytest.raises(report.ReportError, match=re.escape(str(paths["resume"]))):
        report.write_report([paths["selected"]], [paths["summary"]], [paths["resume"]], [paths["data"]], out)
    assert out.read_text() == "previous report"
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".report.html")] == []

    paths["resume"].write_text("[]")
    with pytest.raises(report.ReportError, match="must be a JSON object"):
        report.write_report([paths["selected"]], [], [paths["resume"]], [], out)
    with pytest.raises(report.ReportError, match="does not exist"):
        report.write_report([tmp_path / "nope" / "selected.json"], [], [], [], tmp_path / "new.html")
    assert not (tmp_path / "new.html").exists()


def test_robust_to_missing_keys_and_unmatched_inputs(tmp_path):
    """A selection with no candidate table, no training and a resume check from elsewhere that failed: still shown, never hidden."""
    row = {"id": "x", "candidate": {}, "predicted": {}, "source": "predicted", "fits": True, "reason": ""}
    sel = _write(tmp_path / "a" / "selected.json", {
        "model": "m", "gpu": "g", "method": "sft", "selected": row, "candidates": [],
        "budget": {"device_bytes": GiB, "host_bytes": GiB, "headroom": 0.0}, "plan_only": False, "launch": "",
    })  # fmt: skip
    stray = _write(tmp_path / "b" / "verify_resume.json", {"passed": False, "missing_steps": [[8, "train"]]})
    out = tmp_path / "r.html"
    report.write_report(str(sel), [], [stray], [], out)
    text = _text(out.read_text())
    assert "Inputs not matched to a run" in text and "1 step(s) missing after resume" in text
    assert "No training summary was given" in text


def test_selection_rows_are_checked_once_naming_file_and_key(tmp_path):
    """selected.json is what memfit.estimate.selection writes; a row that is not raises before any page is written."""
    paths = _dpo_run(tmp_path)
    sel = json.loads(paths["selected"].read_text())
    sel["candidates"][1]["fits"] = "no"
    _write(paths["selected"], sel)
    out = tmp_path / "r.html"
    with pytest.raises(report.ReportError, match=re.escape(f"{paths['selected']}: candidates[1].fits: expected bool")):
        report.write_report([paths["selected"]], [], [], [], out)
    assert not out.exists()
    # candidates.json beside it is optional: a bad one is a note on the page, not a failure
    sel["candidates"][1]["fits"] = False
    _write(paths["selected"], sel)
    _write(paths["selected"].parent / "candidates.json", {"world_size": 2, "rows": []})
    text = _text(_render(tmp_path, paths))
    assert "predicted breakdown not shown" in text and "budget: missing" in text


def test_an_oom_probe_shows_its_phase_and_bytes(tmp_path):
    """A probe that ran out of memory (the cpu capacity, or CUDA) shows where: phase, op, live bytes
    against the capacity, as memfit.workflow.probe records them."""
    paths = _dpo_run(tmp_path)
    sel = json.loads(paths["selected"].read_text())
    oom = {"phase": "forward", "op": "aten.mm.default", "live_bytes": 97 * MiB, "capacity_bytes": 96 * MiB}
    for row in sel["candidates"]:
        if row["id"] == OOM:
            row["probe"]["oom"] = oom
    paths["selected"].write_text(json.dumps(sel))
    row = next(r for r in re.findall(r"<tr>(.*?)</tr>", _render(tmp_path, paths), re.S) if OOM in r)
    assert "OOM in forward" in _text(row) and "(aten.mm.default)" in row
    assert "97.0 MiB live &gt; 96.0 MiB capacity" in row


def test_predicted_and_measured_step_times_of_the_probes_are_compared(tmp_path):
    paths = _dpo_run(tmp_path)
    sel = json.loads(paths["selected"].read_text())
    third = {
        "id": "z3-nogc-sdpa-full-mb2-s32-fp32-ref-model", "candidate": _cand(3, 2, 8),
        "predicted": _pred(100 * MiB, 120 * MiB, 0.9), "source": "measured", "fits": True,
        "reason": "slower than the selected", "device_bytes": 110 * MiB, "host_bytes": 2 * GiB,
        "step_time_s": 1.0, "tokens_per_s": 2048.0,
        "probe": {"status": "ok", "peak_allocated_bytes": 110 * MiB, "peak_reserved_bytes": None, "step_time_s": 1.0},
    }  # fmt: skip
    sel["candidates"].append(third)
    paths["selected"].write_text(json.dumps(sel))
    text = _text(_render(tmp_path, paths))
    # the winner: 0.42 s predicted, 0.5 s measured (16% off); the third: 0.9 s against 1.0 s (10%)
    assert (
        "Step time of the 2 probed candidates, predicted against measured: median error 13%, worst 16% "
        f"( {WINNER} : predicted 0.420 s, measured 0.500 s), rank correlation (Spearman) 1.00"
        in text  # the worst named
    )


def _answer(page: str) -> str:
    """The answer section's text: from its heading to the contents below it."""
    return _text(page[page.index('<h2 id="runs">') : page.index('<nav class="toc">')])


def test_answer_states_margin_losses_resume_and_predicted_vs_measured(page):
    """The top of the page answers (#43): the configuration in words, the usable budget less the
    training peak, the final losses, the resume verdict, predicted vs measured peak and step time."""
    from memfit.report.fmt import _bytes

    answer = _answer(page)
    usable = 4 * GiB * (1 - 0.1)  # budget 4 GiB, 10% headroom kept free
    left = usable - 158 * MiB  # the training peak (allocated: the CPU reports no reserved figure)
    assert f"{_bytes(left)} ({left / usable:.0%}) below the usable {_bytes(usable)}" in answer
    assert "training peak allocated" in answer
    assert "train 0.45 (step 8) · eval 0.54 (step 8)" in answer
    assert "FAILED" in answer  # the fixture's resume check did not pass
    assert "predicted 150.0 MiB, training 158.0 MiB (-5%)" in answer
    assert "predicted 0.420 s, training 0.500 s (-16%)" in answer
    assert "ZeRO-2, no offload" in answer and WINNER in answer
    # two throughputs, each said with its definition
    assert "training 4,005 tok/s" in answer  # the median of the logged steps and "probe 4,096 tok/s" in answer
    assert (
        "probe tok/s: padded worst-case batch, all ranks" in answer and "training tok/s: real tokens, rank 0" in answer
    )


def test_plan_only_answer_says_why_the_next_best_lost(tmp_path):
    page = _render(tmp_path, _dpo_run(tmp_path, plan_only=True, reason="predicted 1.00 GiB > usable 0.90 GiB"))
    answer = _answer(page)
    assert f"why not the next best: #2 {OOM} does not fit" in answer
    assert "does not fit : predicted 1.00 GiB > usable 0.90 GiB." in answer  # the verdict, then why
    assert "final loss" not in answer and "resume check" not in answer  # nothing trained: no such columns
    assert "predicted 4,096 tok/s" in answer


def test_selection_table_shows_the_top_ten_and_folds_the_rest(tmp_path):
    paths = _dpo_run(tmp_path)
    sel = json.loads(paths["selected"].read_text())
    for i in range(13):
        sel["candidates"].append({
            "id": f"z3-extra-{i:02d}", "candidate": _cand(3, 1, 16), "predicted": _pred(100 * MiB, 120 * MiB, 1.0 + i),
            "source": "predicted", "fits": True, "reason": "not probed: predicted to fit, ranked below the probed candidates",
        })  # fmt: skip
    _write(paths["selected"], sel)
    page = _render(tmp_path, paths)
    shown, folded = page.split('<details class="fold"><summary>5 more candidates, ranked below the top 10</summary>', 1)
    in_view = shown[shown.rindex("<h3>Selection: every candidate</h3>") :]
    assert len(re.findall(r"<tr( class=\"selected\")?><td class=\"n\">\d+</td>", in_view)) == 10
    assert WINNER in in_view and f"z3-extra-{12:02d}" in folded.split("</details>")[0]
