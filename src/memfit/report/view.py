"""What the page shows, as plain data (dicts of numbers and text): templates/*.html.j2 lay it out.

`page_context` is everything `page.html.j2` reads; `run_view` one run's section. Numbers stay
numbers where a template formats them (filters `bytes`, `secs`, `tps`, `plain`); text is plain
text, escaped by the templates. Tables and charts of candidates read the run's rows of the
candidate table (`memfit.results`: `RunOutputs.records`), not selected.json's dicts.
"""

from __future__ import annotations

import datetime
import statistics
from pathlib import Path
from typing import Any

from memfit import __version__

from .answer import PROBE_TPS, TRAIN_TPS, answer_row
from .charts import (
    accuracy_chart,
    breakdown_chart,
    curves_chart,
    length_chart,
    memory_chart,
    memory_compare_chart,
)
from .decision import chosen_because
from .facts import export_files, run_facts
from .fitmap import FitResult, fit_grid, fit_results
from .fmt import _bytes, _measured, _num, _plain, _secs, _tps, _verdict, describe
from .inputs import Inputs, RunOutputs
from .marks import changed_levers, read_fallbacks, training_marks

SHOWN = 10  # the selection table shows the ten best-ranked candidates; the rest fold away


def resume_status(check: dict[str, Any] | None) -> tuple[str, str]:
    """(word, css class) of a resume check's verdict."""
    if check is None:
        return "not checked", "muted"
    passed = check.get("passed")
    if passed is True:
        return "passed", "ok"
    if passed is False:
        return "FAILED", "bad"
    return "unknown (no 'passed' field)", "bad"


def _yes_no(x: Any) -> str:
    if isinstance(x, bool):
        return "yes" if x else "no"
    return "—" if x is None else str(x)


def resume_view(check: dict[str, Any], path: Path | None) -> dict[str, Any]:
    """A verify_resume.json: the verdict, why it failed, and its figures as (label, text) pairs."""
    status, _ = resume_status(check)
    missing = check.get("missing_steps") or []
    why = [f"{len(missing)} step(s) missing after resume"] if missing else []
    rel, rtol = _num(check.get("max_rel_loss_diff")), _num(check.get("rtol"))
    if rel is not None and rtol is not None and rel > rtol:
        why.append(f"max relative loss difference {rel:.3g} > tolerance {rtol:.3g}")
    head = "Resume check did NOT pass" if status == "FAILED" else "Resume check result unknown"
    pairs = [
        ("final step", _plain(check.get("final_step"))),
        ("steps compared", _plain(check.get("steps_compared"))),
        (
            "missing steps",
            ", ".join(f"{m[0]} ({m[1]})" if isinstance(m, list) and len(m) == 2 else str(m) for m in missing) or "none",
        ),
        (
            "max relative loss difference",
            f"{_plain(check.get('max_rel_loss_diff'))} (tolerance {_plain(check.get('rtol'))})",
        ),
        ("losses bitwise equal", _yes_no(check.get("losses_bitwise_equal"))),
        ("weights max abs difference", _plain(check.get("weights_max_abs_diff"))),
        ("weights bitwise equal", _yes_no(check.get("weights_bitwise_equal"))),
    ]
    if check.get("resume_peak_allocated_bytes") is not None:
        # resume is where runs die a second time: the load's peak beside the training peak
        train_peak, resume_peak = check.get("training_peak_allocated_bytes"), check["resume_peak_allocated_bytes"]
        ratio = (
            f" ({resume_peak / train_peak:.2f}x the training peak)"
            if isinstance(train_peak, (int, float)) and train_peak > 0
            else ""
        )
        pairs += [
            ("device peak while loading the checkpoint", _bytes(resume_peak) + ratio),
            ("training peak (uninterrupted run)", _bytes(train_peak)),
            ("host RSS after loading, largest rank", _bytes(check.get("resume_host_rss_bytes"))),
            ("host RSS of training, largest rank", _bytes(check.get("training_host_rss_bytes"))),
        ]
    return {
        "passed": status == "passed",
        "status": status,
        "headline": head + (": " + "; ".join(why) if why else ""),
        "path": path,
        "resumed_from": check.get("resumed_from", "—"),
        "from_step": check.get("from_step"),
        "pairs": pairs,
    }


def training_pairs(summary: dict[str, Any], metrics: list[dict[str, Any]] | None = None) -> list[tuple[str, str]]:
    """A training summary (and its metrics: throughput, final losses) as (label, text) pairs."""
    reserved = summary.get("peak_reserved_bytes")
    pairs = [
        ("steps", _plain(summary.get("steps"))),
        ("ranks", _plain(summary.get("world_size"))),
        ("device", summary.get("device", "—")),
        ("peak allocated per device", _bytes(summary.get("peak_allocated_bytes"))),
        ("peak reserved per device", _bytes(reserved) if reserved is not None else "— (not reported on this device)"),
        ("host RSS, largest rank", _bytes(summary.get("host_rss_bytes_max_rank"))),
        ("host RSS, node total", _bytes(summary.get("host_rss_bytes_node"))),
        ("first step time", _secs(summary.get("first_step_time_s"))),
        ("step time (median after the first)", _secs(summary.get("step_time_s"))),
        ("memory measured by", summary.get("memory_source", "—")),
    ]
    if summary.get("resume_peak_allocated_bytes") is not None:
        # its last launch resumed: what loading the checkpoint cost, beside the training peaks above
        pairs += [
            ("device peak while loading the checkpoint", _bytes(summary["resume_peak_allocated_bytes"])),
            ("host RSS after loading the checkpoint, largest rank", _bytes(summary.get("resume_host_rss_bytes"))),
        ]
    train = [r for r in metrics or [] if r.get("split", "train") == "train"]
    tps = sorted(v for v in (_num(r.get("tokens_per_s")) for r in train) if v is not None)
    if tps:
        pairs.append(("training throughput (real tokens, rank 0; median of logged steps)", _tps(tps[len(tps) // 2])))
    for split in ("train", "eval"):
        last = next(
            (
                r
                for r in reversed(metrics or [])
                if r.get("split", "train") == split and _num(r.get("loss")) is not None
            ),
            None,
        )
        if last is not None:
            pairs.append((f"final {split} loss (step {last['step']})", _plain(last["loss"])))
    for key, what in FINAL_ACCURACIES:  # held-out pairs ranked right: what a preference run is for
        last = next(
            (r for r in reversed(metrics or []) if r.get("split") == "eval" and _num(r.get(key)) is not None), None
        )
        if last is not None:
            pairs.append((what, f"{_num(last[key]):.3f} at step {last['step']} (chance 0.5)"))
    return pairs


# the held-out accuracy each method logs under TRL's names: rm's score ranks the chosen response
# higher (RewardTrainer's `accuracy`); DPO, ORPO and SimPO's implicit rewards do
# (`rewards/accuracies`); KTO's rows are unpaired and have none
FINAL_ACCURACIES = (
    ("accuracy", "held-out pair accuracy"),
    ("rewards/accuracies", "held-out reward accuracy"),
)


def _or_predicted(value: Any, predicted: Any, fmt) -> str:
    if value is not None:
        return fmt(value)
    return f"{fmt(predicted)} (predicted)" if predicted is not None else "—"


def _selection_row(r: dict[str, Any], selected_id: str | None) -> dict[str, Any]:
    """One candidate of the selection table: its record's figures, the verdict and why."""
    value, kind = _measured(r)
    oom = {k: r[f"probe_oom_{k}"] for k in ("phase", "op", "live_bytes", "capacity_bytes")}
    verdict, vcls = _verdict(r, selected_id)
    return {
        "rank": r["rank"],
        "id": r["id"],
        "selected": r["id"] == selected_id,
        "predicted_total": r["predicted_device_total_bytes"],
        "measured": {
            "value": value,
            "kind": kind,
            "oom": oom if kind == "OOM" and any(v is not None for v in oom.values()) else None,
        },
        # a row judged without figures of its own (probe failed, cannot run) shows the prediction, marked
        "host": _or_predicted(r["host_bytes"], r["predicted_host_bytes"], _bytes),
        "step": _or_predicted(r["step_time_s"], r["predicted_step_time_s"], _secs),
        "tokens_per_s": r["tokens_per_s"],
        "source": r["source"],
        "verdict": verdict,
        "verdict_class": vcls,
        "reason": r["reason"],
    }


def selection_table(run: RunOutputs) -> dict[str, list[dict[str, Any]]]:
    """Every ranked candidate: the top SHOWN (the selected one among them wherever it ranks) in view,
    the rest (`rest`) folded below, ranks kept, so a long search space does not bury the answer."""
    sid = run.selected_id
    rows = [_selection_row(r, sid) for r in run.ranked]
    if len(rows) <= SHOWN:
        return {"weighed": rows, "rest": []}
    top = rows[:SHOWN] + [r for r in rows[SHOWN:] if r["selected"]]
    return {"weighed": top, "rest": [r for r in rows[SHOWN:] if not r["selected"]]}


def time_check(run: RunOutputs) -> dict[str, Any] | None:
    """Predicted vs measured step time of the probed candidates: the median and worst |error| and
    Spearman's rank correlation (does the estimator order them as the machine does?)."""
    from memfit.estimate.time.timing import spearman

    pairs = [
        (r["id"], float(r["predicted_step_time_s"]), float(r["probe_step_time_s"]))
        for r in run.ranked
        if _num(r.get("probe_step_time_s")) and _num(r.get("predicted_step_time_s"))
    ]
    if len(pairs) < 2:
        return None
    errs = sorted(abs(p / m - 1) for _, p, m in pairs)
    worst = max(pairs, key=lambda x: abs(x[1] / x[2] - 1))
    rho = spearman([p for _, p, _ in pairs], [m for _, _, m in pairs])
    return {
        "n": len(pairs),
        "median_error": statistics.median(errs),
        "worst_error": errs[-1],
        "worst": {"id": worst[0], "predicted": worst[1], "measured": worst[2]},
        "spearman": None if rho != rho else rho,  # nan: a constant side
    }


def memory_compare(run: RunOutputs) -> dict[str, Any] | None:
    """Training peak vs the probe's and the prediction's, for the selected candidate."""
    s = run.selected
    if s is None:
        return None
    pred = {
        k: getattr(s.predicted, k) for k in ("peak_allocated_bytes", "peak_reserved_bytes", "host_bytes", "step_time_s")
    }
    probe = s.probe
    figures = [("predicted", pred)]
    if probe and probe.get("status", "ok") == "ok":
        figures.append(("probe (worst-case batch)", probe))
    figures.append(("training", run.summary or {}))
    rows = []
    for name, f in figures:
        host = f.get("host_rss_bytes_node") if name != "predicted" else f.get("host_bytes")
        rows.append((name, f.get("peak_allocated_bytes"), f.get("peak_reserved_bytes"), host, f.get("step_time_s")))
    out: dict[str, Any] = {"rows": rows, "ratio": None, "no_probe": probe is None and not run.selection.plan_only}
    train_peak = _num((run.summary or {}).get("peak_allocated_bytes"))
    probe_peak = _num((probe or {}).get("peak_allocated_bytes"))
    if train_peak and probe_peak:
        ratio = train_peak / probe_peak
        out["ratio"] = ratio
        out["ratio_word"] = "above" if ratio > 1.02 else "within 2% of" if ratio >= 0.98 else "below"
        out["ratio_class"] = "bad" if ratio > 1.02 else ""
    out["chart"] = memory_compare_chart(figures, run.title)
    return out


def reference_compare(run: RunOutputs) -> dict[str, Any] | None:
    """DPO: the same candidate probed without and with a reference model in memory."""
    pair = run.table.reference_compare if run.table is not None else None
    if run.selection.method != "dpo" or pair is None:
        return None
    by_id = {r["id"]: r for r in run.ranked}
    rows, figures, peaks = [], [], {}
    for mode, cid in pair.items():
        r = by_id.get(cid) or {}
        status = r.get("probe_status")
        ok = status == "ok"
        peak = r.get("probe_peak_allocated_bytes") if ok else None
        reserved = r.get("probe_peak_reserved_bytes") if ok else None
        rows.append({"mode": mode, "id": cid, "peak": peak, "reserved": reserved, "predicted": r.get("predicted_device_total_bytes"),
                     "ok": ok, "status": "ok" if ok else str(status or "not probed")})  # fmt: skip
        peaks[mode] = _num(peak)
        if ok:
            figures.append((f"ref: {mode}", {"peak_allocated_bytes": peak, "peak_reserved_bytes": reserved}))
    base = peaks.pop("model", None)
    savings = [
        {"mode": mode, "peak": peak, "base": base, "saved": base - peak if base and peak else None}
        for mode, peak in peaks.items()
    ]
    chart = None
    if len(figures) == 2:
        chart = memory_compare_chart(
            figures, run.title, what="DPO reference modes", measured_from=0, alt="dpo reference: precomputed vs model"
        )
    return {"rows": rows, "savings": savings, "chart": chart}


def _training_word(run: RunOutputs) -> str:
    if run.selection.plan_only:
        return "plan only"
    if not run.summary:
        return "no training summary"
    fallbacks, _ = read_fallbacks(run.summary)
    if fallbacks:
        return f"trained; {len(fallbacks)} OOM fallback(s), finished on {fallbacks[-1].dst}"
    return "trained"


def overview(runs: list[RunOutputs]) -> dict[str, Any]:
    """What the answer table says of all runs at once: nothing trained anywhere, some run where nothing fits."""
    return {"plan": all(r.selection.plan_only for r in runs), "none_fits": any(r.selected is None for r in runs)}


def run_view(
    run: RunOutputs, i: int, data_anchor: str | None, fit: FitResult, link_base: Path | None
) -> dict[str, Any]:
    """One run's section: what was selected and why, will it fit, what hardware fits, did training work."""
    sel = run.selection
    world = (run.summary or {}).get("world_size") or (run.table.world_size if run.table is not None else None)
    est = next((r for r in run.table.rows if r.id == run.selected_id), None) if run.table is not None else None
    view: dict[str, Any] = {
        "index": i, "title": run.title, "path": run.path, "plan_only": sel.plan_only, "notes": run.notes,
        "model": sel.model, "gpu": sel.gpu, "method": sel.method, "launch": sel.launch, "budget": sel.budget,
        "selected": run.selected, "none_fits": run.none_fits, "shown_id": run.shown.id if run.shown else None,
        "described": describe(run.selected.candidate, str(sel.method), world) if run.selected else "",
        "chosen_because": chosen_because(run.selected, run.rows),
        "estimator_notes": (est.notes or []) if est is not None else [],
        "run_dir": Path(run.path).parent, "exports": export_files(Path(run.path).parent, str(sel.method), link_base),
        "data_anchor": data_anchor, "selection_table": selection_table(run),
        "time_check": time_check(run),
        "memory_chart": memory_chart(run), "estimator": run.table.estimator if run.table is not None else None,
        "breakdown_chart": breakdown_chart(run), "accuracy_chart": accuracy_chart(run), "fit": fit,
        "summary": run.summary, "summary_path": run.summary_path,
        "resume": resume_view(run.resume, run.resume_path) if run.resume is not None else None,
    }  # fmt: skip
    if sel.plan_only or run.summary is None:  # nothing trained: no training figures to compute
        return view
    fallbacks, notes = read_fallbacks(run.summary)
    marks = training_marks(run)
    view |= {
        "fallbacks": fallbacks, "fallback_notes": notes,
        "fallbacks_changed": [(f, changed_levers(run, f.src, f.dst)) for f in fallbacks],
        "training": training_pairs(run.summary, run.metrics), "has_metrics": bool(run.metrics), "marks": marks,
        "curves": curves_chart(run.metrics, run.title, marks) if run.metrics else None,
        "memory_compare": memory_compare(run), "reference_compare": reference_compare(run),
    }  # fmt: skip
    return view


def data_identity(path: Path, stats: dict[str, Any]) -> tuple[str, str]:
    """(model, method) from `results/{model}/data/{method}/stats.json`, else what the file says."""
    method = str(stats.get("method") or path.parent.name)
    model = path.parent.parent.parent.name if path.parent.parent.name == "data" else "?"
    return model, method


def data_section(path: Path, stats: dict[str, Any], anchor: str) -> dict[str, Any]:
    """One stats.json: where the data came from, what was kept, dropped and truncated, row lengths."""
    model, method = data_identity(path, stats)
    title = f"{model} · {method}"
    kept = stats.get("rows_kept") if isinstance(stats.get("rows_kept"), dict) else {}
    pairs = [
        ("max_len", f"{_plain(stats.get('max_len'))} tokens"),
        ("rows read", _plain(stats.get("rows_read"))),
        ("rows kept", f"{_plain(kept.get('train'))} train, {_plain(kept.get('eval'))} eval"),
        ("tokens stored", _plain(stats.get("tokens"))),
    ]
    counts = []
    for key, label in (("dropped", "rows dropped"), ("truncated", "rows truncated")):
        c = stats.get(key) if isinstance(stats.get(key), dict) else {}
        total = sum(v for v in map(_num, c.values()) if v is not None)
        counts.append((label, total, list(c.items())))
    length = stats.get("length") if isinstance(stats.get("length"), dict) else {}
    keys = [k for k in ("min", "mean", "p50", "p90", "p99", "max") if k in length]
    return {
        "anchor": anchor, "title": title, "path": path, "source": stats.get("source", "—"), "pairs": pairs,
        "counts": counts, "length_keys": keys, "length": [(k, length[k]) for k in keys],
        "length_brief": ", ".join(f"{k} {_plain(length[k], 5)}" for k in ("p50", "max") if k in length),
        "chart": length_chart(stats, title) if length else None,
    }  # fmt: skip


def page_context(
    inputs: Inputs, facts_root: Path | None = None, link_base: Path | None = None, bench_dir: Path | None = None
) -> dict[str, Any]:
    """Everything page.html.j2 shows (`bench_dir`: this run's benchmark folder, see facts.run_facts)."""
    runs = inputs.runs

    def distinct(key: str) -> str:
        vals = list(
            dict.fromkeys(str(getattr(r.selection, key)) for r in runs if getattr(r.selection, key) is not None)
        )
        return ", ".join(vals) or "—"

    failed = [r.title for r in runs if r.resume is not None and resume_status(r.resume)[0] != "passed"]
    failed += [str(p) for p, c in inputs.loose_resume if resume_status(c)[0] != "passed"]
    data_anchor: dict[tuple[str, str], str] = {}
    for i, (p, s) in enumerate(inputs.stats):
        data_anchor.setdefault(data_identity(p, s), f"data-{i}")
    fits = fit_results(runs, facts_root or Path.cwd())
    contents: dict[str, list[tuple[int, str, str]]] = {}
    for i, r in enumerate(runs):
        contents.setdefault(str(r.selection.model), []).append((i, str(r.selection.gpu), str(r.selection.method)))
    loose = {
        "summaries": [{"path": p, "training": training_pairs(s), "notes": notes, "curves": curves_chart(metrics, str(p)) if metrics else None}
                      for p, s, metrics, notes in inputs.loose_summaries],
        "resume": [resume_view(c, p) for p, c in inputs.loose_resume],
    }  # fmt: skip
    return {
        "generated": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "version": __version__,
        "distinct": {"models": distinct("model"), "gpus": distinct("gpu"), "methods": distinct("method")},
        "contents": contents,
        "resume_failed": failed,
        "runs": [
            run_view(r, i, data_anchor.get((str(r.selection.model), str(r.selection.method))), fits[i], link_base)
            for i, r in enumerate(runs)
        ],
        "overview": overview(runs),
        "answer": {
            "rows": [
                answer_row(r, i, resume_status(r.resume)) | {"training_word": _training_word(r)}
                for i, r in enumerate(runs)
            ],
            "probe_tps": PROBE_TPS,
            "train_tps": TRAIN_TPS,
        },  # fmt: skip
        "grid": fit_grid(runs, fits),
        "loose": loose,
        "data": {
            "plan_only": bool(runs) and all(r.selection.plan_only for r in runs),
            "sections": [data_section(p, s, f"data-{i}") for i, (p, s) in enumerate(inputs.stats)],
        },  # fmt: skip
        "facts": (
            run_facts(facts_root, bench_dir, {str(r.selection.model) for r in runs}) if facts_root is not None else None
        ),
    }
