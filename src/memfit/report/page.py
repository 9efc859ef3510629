"""The page itself: one self-contained HTML file (inline CSS and images, no script, no external URL)."""

from __future__ import annotations

import datetime
from dataclasses import asdict
from pathlib import Path
from typing import Any

from memfit import __version__

from .charts import (
    MAX_BARS,
    accuracy_chart,
    breakdown_chart,
    curves_chart,
    length_chart,
    memory_chart,
    memory_compare_chart,
)
from .facts import exports_block, facts_section
from .fitmap import FitResult, fit_grid, fit_map, fit_results
from .fmt import _bytes, _e, _measured, _num, _plain, _secs, _tps, _verdict, describe
from .inputs import Inputs, RunOutputs
from .marks import fallbacks_block, marks_table, read_fallbacks, training_marks

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto; max-width: 1200px; padding: 1em 2em; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 2px solid #ddd; padding-bottom: 0.2em; margin-top: 2em; }
h3 { margin-top: 1.4em; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.n { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr.selected td { background: #e6f4ea; font-weight: 600; }
code, pre { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px; }
pre { background: #f6f8fa; border: 1px solid #ddd; padding: 0.6em; overflow-x: auto; white-space: pre-wrap; }
.ok { color: #1a7f37; font-weight: 600; } .bad { color: #c62828; font-weight: 600; }
.banner { padding: 0.6em 1em; border-radius: 4px; margin: 0.8em 0; font-weight: 600; }
.banner.pass { background: #e6f4ea; border: 1px solid #1a7f37; color: #1a7f37; }
.banner.fail { background: #fdecea; border: 1px solid #c62828; color: #c62828; }
.banner.info { background: #eef3fb; border: 1px solid #4c72b0; color: #2b4a80; }
.banner.warn { background: #fff4e0; border: 1px solid #b26a00; color: #8a5200; }
.wide { max-width: 100%; overflow-x: auto; }
table.grid th, table.grid td { padding: 2px 6px; } table.grid td.ok { background: #e6f4ea; }
table.grid td.short { background: #fff4e0; color: #8a5200; } table.grid td.bad { color: #c62828; font-weight: normal; }
td.here, tr.here td { outline: 2px solid #222; outline-offset: -2px; font-weight: 600; }
ul.legend { font-size: 12px; color: #444; list-style: none; padding-left: 0; }
.muted { color: #666; } img.plot { max-width: 100%; display: block; margin: 0.6em 0; }
.note { color: #8a5a00; }
nav.toc { margin: 0.8em 0; line-height: 1.7; } nav.toc a { white-space: nowrap; }
nav.toc ul { margin: 0.2em 0; padding-left: 1.2em; } nav.toc .model { font-weight: 600; }
details.run { margin-top: 1.5em; } details.run > summary { cursor: pointer; color: #666; font-size: 12px; }
details.run > summary + h2 { margin-top: 0.3em; }
@media print {
  body { max-width: none; padding: 0; font-size: 11px; }
  h2 { break-before: auto; break-after: avoid; } h3 { break-after: avoid; }
  img.plot, tr, pre, .banner { break-inside: avoid; }
  a { color: inherit; text-decoration: none; } nav.toc, details.run > summary { display: none; }
  tr.selected td, th, .banner, table.grid td { -webkit-print-color-adjust: exact; print-color-adjust: exact; }
  .wide { overflow: visible; }
}
"""


def _table(header: list[str], rows: list[list[tuple[str, str] | str]], row_classes: list[str] | None = None) -> str:
    """Cells are already-escaped HTML; a (html, css class) tuple sets the cell's class."""
    out = ["<table><thead><tr>", *(f"<th>{_e(h)}</th>" for h in header), "</tr></thead><tbody>"]
    for i, row in enumerate(rows):
        cls = row_classes[i] if row_classes and row_classes[i] else ""
        out.append(f'<tr class="{cls}">' if cls else "<tr>")
        for cell in row:
            content, ccls = cell if isinstance(cell, tuple) else (cell, "")
            out.append(f'<td class="{ccls}">{content}</td>' if ccls else f"<td>{content}</td>")
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _kv(pairs: list[tuple[str, str]]) -> str:
    return "<table>" + "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in pairs) + "</table>"


def _notes(notes: list[str]) -> str:
    return "".join(f'<p class="note">Note: {_e(n)}</p>' for n in notes)


def _resume_status(check: dict[str, Any] | None) -> tuple[str, str]:
    if check is None:
        return "not checked", "muted"
    passed = check.get("passed")
    if passed is True:
        return "passed", "ok"
    if passed is False:
        return "FAILED", "bad"
    return "unknown (no 'passed' field)", "bad"


def render(inputs: Inputs, facts_root: Path | None = None, link_base: Path | None = None) -> str:
    """The whole page as one string; with `facts_root` (the Snakemake working directory) a "Run facts" section.
    `link_base` is the folder the page is written to: links to each run's launch files and exports
    are relative to it (absolute file:// links without it)."""
    runs, stats, loose_summaries, loose_resume = inputs.runs, inputs.stats, inputs.loose_summaries, inputs.loose_resume

    def distinct(key: str) -> str:
        vals = list(dict.fromkeys(str(getattr(r.selection, key)) for r in runs if getattr(r.selection, key) is not None))
        return ", ".join(vals) or "—"

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    body = [
        "<h1>memfit report</h1>",
        f'<p class="muted">Generated {_e(now)} by memfit {_e(__version__)}.</p>',
        _kv([("models", _e(distinct("model"))), ("GPUs", _e(distinct("gpu"))), ("methods", _e(distinct("method"))), ("runs", str(len(runs)))]),
    ]
    failed = [r.title for r in runs if _resume_status(r.resume)[0] != "passed" and r.resume is not None]
    failed += [str(p) for p, c in loose_resume if _resume_status(c)[0] != "passed"]
    if failed:
        body.append(f'<div class="banner fail">Resume check did NOT pass for: {_e(", ".join(failed))}. Resuming from a checkpoint does not reproduce the uninterrupted run there; see the resume sections below.</div>')
    body.append(_overview(runs))
    data_anchor = {}
    for i, (p, s) in enumerate(stats):
        model, method = _data_identity(p, s)
        data_anchor.setdefault((model, method), f"data-{i}")
    fits = fit_results(runs, facts_root or Path.cwd())
    body.insert(3, _contents(runs, facts_root is not None))
    body.append(_fit_grid_section(runs, fits))
    for i, run in enumerate(runs):
        anchor = data_anchor.get((str(run.selection.model), str(run.selection.method)))
        section = _run_section(run, i, anchor, fits[i], link_base)
        if len(runs) > 1:  # several combinations: each one folds (open by default, so it prints)
            section = f'<details open class="run"><summary>{_e(run.title)}</summary>\n{section}\n</details>'
        body.append(section)
    if loose_summaries or loose_resume:
        body.append("<h2>Inputs not matched to a run</h2>")
        body.append('<p class="muted">These files are not in a run directory of any selected.json given to the report.</p>')
        for p, summary, metrics, notes in loose_summaries:
            body.append(f"<h3>Training: <code>{_e(p)}</code></h3>")
            body.append(_training_table(summary) + _notes(notes))
            if metrics:
                body.append(curves_chart(metrics, str(p)))
        for p, check in loose_resume:
            body.append(f"<h3>Resume check: <code>{_e(p)}</code></h3>" + _resume_block(check, p))
    body.append('<h2 id="data">Data</h2>')
    if not stats:
        plan = bool(runs) and all(r.selection.plan_only for r in runs)
        body.append("<p>Plan only: the data was not prepared, so there are no length statistics.</p>" if plan
                    else "<p>No data statistics were given (data not prepared).</p>")  # fmt: skip
    for i, (p, s) in enumerate(stats):
        body.append(_data_section(p, s, f"data-{i}"))
    if facts_root is not None:
        body.append(facts_section(facts_root))
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>memfit report: {_e(distinct('model'))}</title><style>{CSS}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def _contents(runs: list[RunOutputs], facts: bool) -> str:
    """Contents: the overview and fit map, every run (model x GPU x method) grouped by model, data, run facts."""
    items = ['<a href="#runs">Runs</a>', '<a href="#fitmap">What hardware fits</a>']
    models: dict[str, list[str]] = {}
    for i, r in enumerate(runs):
        s = r.selection
        models.setdefault(str(s.model), []).append(f'<a href="#run-{i}">{_e(s.gpu)} · {_e(s.method)}</a>')
    lines = [" · ".join(items)]
    lines += [f'<span class="model">{_e(m)}</span>: {" · ".join(links)}' for m, links in models.items()]
    tail = ['<a href="#data">Data</a>'] + (['<a href="#facts">Run facts</a>'] if facts else [])
    lines.append(" · ".join(tail))
    return '<nav class="toc"><b>Contents</b><ul>' + "".join(f"<li>{x}</li>" for x in lines) + "</ul></nav>"


def _fit_grid_section(runs: list[RunOutputs], fits: list[FitResult]) -> str:
    head = '<h2 id="fitmap">What hardware fits: GPU type × model × method</h2>'
    if not runs:
        return head + "<p>No runs were given.</p>"
    return (
        head
        + '<p class="muted">For each selected setup (its ZeRO stage, offload, checkpointing, micro batch and precision, on as many GPUs '
        "as the run): the longest sequence, in tokens, whose predicted peak fits one GPU of each catalog type with that type's "
        "typical node RAM (<code>memfit fit --maximize seq_len</code>). Green: the selected sequence length fits; amber: only a "
        "shorter one; —: not even one token. Outlined: the GPU types the setup was selected for. Each run's section below lists "
        "why a GPU type cannot train it at all.</p>"
        + fit_grid(runs, fits)
    )


def _training_word(run: RunOutputs) -> str:
    if run.selection.plan_only:
        return "plan only"
    if not run.summary:
        return "no training summary"
    fallbacks, _ = read_fallbacks(run.summary)
    if fallbacks:
        return f"trained; {len(fallbacks)} OOM fallback(s), finished on {fallbacks[-1].dst}"
    return "trained"


def _overview(runs: list[RunOutputs]) -> str:
    if not runs:
        return '<h2 id="runs">Runs</h2><p>No runs were given.</p>'
    plan = all(r.selection.plan_only for r in runs)  # nothing trained anywhere: no training columns
    rows = []
    for i, run in enumerate(runs):
        s = run.selected
        status, cls = _resume_status(run.resume)
        word = _training_word(run)
        if s is None:  # a plan where nothing fits: that is the answer, with why
            dash = ("—", "n")
            cells = [f'<a href="#run-{i}">{_e(run.title)}</a>', (f"does not fit: {_e(run.none_fits)}", "bad"), dash, "—", dash]
            rows.append(cells + ([] if plan else [_e(word), (_e(status), cls)]))
            continue
        row = [
            f'<a href="#run-{i}">{_e(run.title)}</a>',
            f"<code>{_e(s.id)}</code>",
            (_bytes(s.device_bytes), "n"),
            _e(s.source),
            (_tps(s.tokens_per_s), "n"),
        ]
        if not plan:
            row += [(_e(word), "bad" if "fallback" in word else ""), (_e(status), cls)]
        rows.append(row)
    header = ["run (model · GPU · method)", "selected candidate", "device peak", "judged on", "throughput"]
    if not plan:
        header += ["training", "resume check"]
    note = '<p class="muted">Plan only: nothing was probed or trained; the figures are predictions.</p>' if plan else ""
    if any(r.selected is None for r in runs):
        note += '<p class="bad">No candidate fits the budget of some runs: see "does not fit" below and each run\'s section.</p>'
    return '<h2 id="runs">Runs</h2>' + note + _table(header, rows)


def _run_section(run: RunOutputs, i: int, data_anchor: str | None, fits: FitResult, link_base: Path | None = None) -> str:
    """One run, in the order a reader asks: what was selected and why, will it fit, what hardware
    fits, did training work (not for a plan-only run: it has no training sections)."""
    sel = run.selection
    method = sel.method
    world = (run.summary or {}).get("world_size") or (run.table.world_size if run.table is not None else None)
    out = [f'<h2 id="run-{i}">{_e(run.title)}</h2>', f'<p class="muted">From <code>{_e(run.path)}</code>.</p>']
    if sel.plan_only:
        out.append('<div class="banner info">Plan only: no probe ran and nothing was trained; the selection rests on predictions for hardware that is not here.</div>')
    out.append(_notes(run.notes))
    if run.selected is None:
        out.append("<h3>Selected configuration: none, it does not fit</h3>")
        out.append(f'<div class="banner fail">Does not fit: {_e(run.none_fits)}</div>')
        out.append(_budget_line(run))
    else:
        out.append("<h3>Selected configuration</h3>")
        out.append(_selected_block(run, method, world))
    if sel.launch:
        out.append(f"<p>Launch command:</p><pre><code>{_e(sel.launch)}</code></pre>")
    out.append(exports_block(Path(run.path).parent, str(method), link_base))
    if data_anchor:
        out.append(f'<p>Data: <a href="#{data_anchor}">statistics for {_e(sel.model)} · {_e(method)}</a>.</p>')
    out.append("<h3>Selection: every candidate</h3>")
    out.append(_selection_table(run))

    out.append("<h3>Will it fit? Memory per candidate</h3>")
    out.append(
        '<p class="muted">Predicted vs measured peak per device; the black line is the device budget, the red band the '
        "headroom kept free. With probes the bars compare like with like (peak reserved on a GPU, peak allocated on the CPU); "
        f"without, the prediction is the device total selection judges. At most {MAX_BARS} candidates, best ranked first.</p>"
    )
    out.append(memory_chart(run))
    out.append("<h4>Predicted memory breakdown</h4>")
    if run.table is not None and run.table.estimator:
        out.append(f'<p class="muted">Predicted by {_e(run.table.estimator)}.</p>')
    out.append(breakdown_chart(run))
    out.append(accuracy_chart(run))
    out.append("<h3>What hardware fits: longest sequence per GPU type</h3>")
    out.append(fit_map(run, fits))

    if sel.plan_only:  # nothing trained, nothing to resume: no training sections at all
        return "\n".join(out)
    out.append("<h3>Did training work?</h3>")
    if run.summary is None:
        out.append("<p>No training summary was given for this run.</p>")
    else:
        marks = training_marks(run)
        out.append(f'<p class="muted">From <code>{_e(run.summary_path)}</code>.</p>')
        out.append(fallbacks_block(run))
        out.append(_training_table(run.summary, run.metrics))
        if run.metrics:
            out.append(
                '<p class="muted">Every metric the training logged, per optimizer step: lines are training steps, dots '
                "evaluations on the held-out rows; vertical lines mark resumes, OOM fallbacks (the steps run again after an OOM "
                "are shaded) and where the resume check restarted.</p>"
            )
            out.append(curves_chart(run.metrics, run.title, marks))
            out.append(marks_table(marks))
        out.append(_memory_compare(run))
        out.append(_reference_compare(run))
    out.append("<h3>Resume check</h3>")
    if run.resume is None:
        out.append("<p>No resume check was given for this run.</p>")
    else:
        out.append(_resume_block(run.resume, run.resume_path))
    return "\n".join(out)


def _selected_block(run: RunOutputs, method: str, world: Any) -> str:
    """The selected candidate in words and the figures it was chosen on, and the budget."""
    s = run.selected
    assert s is not None  # a run where nothing fits shows its reason instead
    out = [f"<p><code>{_e(s.id)}</code>: {_e(describe(s.candidate, method, world))}.</p>"]
    out.append(
        f"<p>Chosen on {_e(s.source)} figures: device peak {_e(_bytes(s.device_bytes))}, "
        f"host {_e(_bytes(s.host_bytes))} per node, step time {_e(_secs(s.step_time_s))}, "
        f"throughput {_e(_tps(s.tokens_per_s))}.</p>"
    )
    est = next((r for r in run.table.rows if r.id == s.id), None) if run.table is not None else None
    if est is not None and est.notes:
        out.append("<p>Estimator notes:</p><ul>" + "".join(f"<li>{_e(n)}</li>" for n in est.notes) + "</ul>")
    out.append(_budget_line(run))
    return "\n".join(out)


def _budget_line(run: RunOutputs) -> str:
    b = run.selection.budget
    dev, head = float(b.device_bytes), float(b.headroom)
    usable = f", {head:.0%} headroom kept free: {_bytes(dev * (1 - head))} usable" if head else ""
    return f"<p>Budget: {_e(_bytes(dev))} per device{_e(usable)}; host RAM {_e(_bytes(b.host_bytes))} per node.</p>"


def _selection_table(run: RunOutputs) -> str:
    rows = run.rows
    if not rows:
        return "<p>selected.json lists no candidates.</p>"
    sid = run.selected_id
    cells, classes = [], []
    for rank, r in enumerate(rows, 1):
        pred = r.predicted
        value, kind = _measured(r)
        if kind in ("reserved", "allocated"):
            measured = (f"{_e(_bytes(value))} <span class='muted'>{_e(kind)}</span>", "n")
        elif kind == "OOM" and (r.probe or {}).get("oom"):
            measured = (_oom_cell(r.probe["oom"]), "n bad")
        elif kind:
            measured = (_e(kind), "n bad")
        else:
            measured = ("not probed", "n muted")
        verdict, vcls = _verdict(r, sid)
        # A row judged without figures of its own (probe failed, cannot run) shows the prediction, marked.
        step = _or_predicted(r.step_time_s, pred.step_time_s, _secs)
        host = _or_predicted(r.host_bytes, pred.host_bytes, _bytes)
        cells.append([
            (str(rank), "n"),
            f"<code>{_e(r.id)}</code>",
            (_e(_bytes(pred.device_total_bytes)), "n"),
            measured,
            (_e(host), "n"),
            (_e(step), "n"),
            (_e(_tps(r.tokens_per_s)), "n"),
            _e(r.source),
            (_e(verdict), vcls),
            _e(r.reason or "—"),
        ])
        classes.append("selected" if r.id == sid else "")
    header = ["#", "candidate", "predicted device total", "measured peak (probe)", "host per node", "step time", "throughput", "judged on", "verdict", "reason"]
    # Candidates judged on predictions alone (never probed) fold away below the ones the selection
    # actually weighed, so a long search space does not bury the probes; ranks are kept.
    # (nothing selected: the closest candidate, ranked first, heads the table)
    weighed = [i for i, r in enumerate(rows) if r.id == sid or r.source != "predicted" or (sid is None and i == 0)]
    rest = [i for i in range(len(rows)) if i not in set(weighed)]
    if len(rest) <= 5 or not weighed:
        return _table(header, cells, classes)
    return (
        _table(header, [cells[i] for i in weighed], [classes[i] for i in weighed])
        + f"<details><summary>{len(rest)} more candidates judged on predictions only (not probed)</summary>"
        + _table(header, [cells[i] for i in rest], [classes[i] for i in rest])
        + "</details>"
    )


def _oom_cell(oom: dict[str, Any]) -> str:
    """Where a probe ran out of device memory: the phase (and op), the bytes live then, the capacity."""
    where = _e(oom.get("phase") or "unknown phase")
    if oom.get("op"):
        where += f" <span class='muted'>({_e(oom['op'])})</span>"
    live, cap = _num(oom.get("live_bytes")), _num(oom.get("capacity_bytes"))
    at = f"<br>{_e(_bytes(live))} live" if live is not None else ""
    if live is not None and cap is not None:
        at += f" &gt; {_e(_bytes(cap))} capacity"
    return f"OOM in {where}{at}"


def _or_predicted(value: Any, predicted: Any, fmt) -> str:
    if value is not None:
        return fmt(value)
    return f"{fmt(predicted)} (predicted)" if predicted is not None else "—"


def _training_table(summary: dict[str, Any], metrics: list[dict[str, Any]] | None = None) -> str:
    pairs = [
        ("steps", _e(_plain(summary.get("steps")))),
        ("ranks", _e(_plain(summary.get("world_size")))),
        ("device", _e(summary.get("device", "—"))),
        ("peak allocated per device", _e(_bytes(summary.get("peak_allocated_bytes")))),
        ("peak reserved per device", _e(_bytes(summary.get("peak_reserved_bytes")) if summary.get("peak_reserved_bytes") is not None else "— (not reported on this device)")),
        ("host RSS, largest rank", _e(_bytes(summary.get("host_rss_bytes_max_rank")))),
        ("host RSS, node total", _e(_bytes(summary.get("host_rss_bytes_node")))),
        ("first step time", _e(_secs(summary.get("first_step_time_s")))),
        ("step time (median after the first)", _e(_secs(summary.get("step_time_s")))),
        ("memory measured by", _e(summary.get("memory_source", "—"))),
    ]
    train = [r for r in metrics or [] if r.get("split", "train") == "train"]
    tps = sorted(v for v in (_num(r.get("tokens_per_s")) for r in train) if v is not None)
    if tps:
        pairs.append(("throughput (median of logged steps)", _e(_tps(tps[len(tps) // 2]))))
    last = {split: next((r for r in reversed(metrics or []) if r.get("split", "train") == split and _num(r.get("loss")) is not None), None) for split in ("train", "eval")}
    for split, r in last.items():
        if r is not None:
            pairs.append((f"final {split} loss (step {r['step']})", _e(_plain(r["loss"]))))
    return _kv(pairs)


def _memory_compare(run: RunOutputs) -> str:
    """Training peak vs the probe's and the prediction's, for the selected candidate."""
    s = run.selected
    if s is None:
        return ""
    pred = asdict(s.predicted)
    probe = s.probe
    figures = [("predicted", pred)]
    if probe and probe.get("status", "ok") == "ok":
        figures.append(("probe (worst-case batch)", probe))
    figures.append(("training", run.summary or {}))
    rows = []
    for name, f in figures:
        host = f.get("host_rss_bytes_node") if name != "predicted" else f.get("host_bytes")
        rows.append([_e(name), (_e(_bytes(f.get("peak_allocated_bytes"))), "n"), (_e(_bytes(f.get("peak_reserved_bytes"))), "n"), (_e(_bytes(host)), "n"), (_e(_secs(f.get("step_time_s"))), "n")])
    out = ["<h4>Memory: training vs probe vs prediction</h4>", _table(["figures", "peak allocated", "peak reserved", "host per node", "step time"], rows)]
    train_peak = _num((run.summary or {}).get("peak_allocated_bytes"))
    probe_peak = _num((probe or {}).get("peak_allocated_bytes"))
    if train_peak and probe_peak:
        ratio = train_peak / probe_peak
        word = "above" if ratio > 1.02 else "within 2% of" if ratio >= 0.98 else "below"
        cls = "bad" if ratio > 1.02 else ""
        out.append(f'<p class="{cls}">Training peaked {_e(f"{ratio:.2f}")}× the probe ({word} what the probe measured on the worst-case batch).</p>')
    elif probe is None and not run.selection.plan_only:
        out.append('<p class="muted">The selected candidate has no probe figures to compare with.</p>')
    out.append(memory_compare_chart(figures, run.title))
    return "\n".join(out)


def _reference_compare(run: RunOutputs) -> str:
    """DPO: the same candidate probed without and with a reference model in memory."""
    pair = run.table.reference_compare if run.table is not None else None
    if run.selection.method != "dpo" or pair is None:
        return ""
    by_id = {r.id: r for r in run.rows}
    out = ["<h4>DPO reference: what keeping no reference model saves</h4>"]
    figures, rows, peaks = [], [], {}
    for mode, cid in pair.items():
        row = by_id.get(cid)
        probe = (row.probe if row is not None else None) or {}
        predicted_total = row.predicted.device_total_bytes if row is not None else None
        ok = probe.get("status", "missing") == "ok"
        peak = probe.get("peak_allocated_bytes") if ok else None
        status = "ok" if ok else str(probe.get("status", "not probed"))
        rows.append([f"<code>ref: {_e(mode)}</code>", f"<code>{_e(cid)}</code>", (_e(_bytes(peak)), "n"), (_e(_bytes(probe.get("peak_reserved_bytes") if ok else None)), "n"), (_e(_bytes(predicted_total)), "n"), (_e(status), "n" if ok else "n bad")])
        peaks[mode] = _num(peak)
        if ok:
            figures.append((f"ref: {mode}", probe))
    out.append('<p class="muted">Both candidates were probed on the same worst-case batch with the same ZeRO stage, micro batch and checkpointing; they differ only in where the reference log-probs come from.</p>')
    out.append(_table(["reference", "candidate", "measured peak allocated", "measured peak reserved", "predicted device total", "probe"], rows))
    base = peaks.pop("model", None)
    for mode, peak in peaks.items():
        if base and peak:
            saved = base - peak
            out.append(f"<p>Measured: <code>ref: {_e(mode)}</code> peaked at {_e(_bytes(peak))} per device, <code>ref: model</code> at {_e(_bytes(base))}: {_e(_bytes(abs(saved)))} ({abs(saved) / base:.0%}) {'less' if saved > 0 else 'more'}.</p>")
        else:
            out.append('<p class="bad">The comparison is incomplete: one of the two probes has no measurement (see the probe column).</p>')
    if len(figures) == 2:
        out.append(memory_compare_chart(figures, run.title, what="DPO reference modes", measured_from=0, alt="dpo reference: precomputed vs model"))
    return "\n".join(out)


def _resume_block(check: dict[str, Any], path: Path | None) -> str:
    status, _ = _resume_status(check)
    if status == "passed":
        banner = '<div class="banner pass">Resume check passed: resuming from the checkpoint reproduced the uninterrupted run.</div>'
    else:
        why = []
        missing = check.get("missing_steps") or []
        if missing:
            why.append(f"{len(missing)} step(s) missing after resume")
        rel, rtol = _num(check.get("max_rel_loss_diff")), _num(check.get("rtol"))
        if rel is not None and rtol is not None and rel > rtol:
            why.append(f"max relative loss difference {rel:.3g} > tolerance {rtol:.3g}")
        reason = ": " + "; ".join(why) if why else ""
        head = "Resume check did NOT pass" if status == "FAILED" else "Resume check result unknown"
        banner = f'<div class="banner fail">{_e(head + reason)}. Resuming this run from a checkpoint does not reproduce the uninterrupted trajectory.</div>'
    missing = check.get("missing_steps") or []
    pairs = [
        ("result", _e(status)),
        ("resumed from", f"<code>{_e(check.get('resumed_from', '—'))}</code> (step {_e(_plain(check.get('from_step')))})"),
        ("final step", _e(_plain(check.get("final_step")))),
        ("steps compared", _e(_plain(check.get("steps_compared")))),
        ("missing steps", _e(", ".join(f"{m[0]} ({m[1]})" if isinstance(m, list) and len(m) == 2 else str(m) for m in missing) or "none")),
        ("max relative loss difference", _e(f"{_plain(check.get('max_rel_loss_diff'))} (tolerance {_plain(check.get('rtol'))})")),
        ("losses bitwise equal", _e(_yes_no(check.get("losses_bitwise_equal")))),
        ("weights max abs difference", _e(_plain(check.get("weights_max_abs_diff")))),
        ("weights bitwise equal", _e(_yes_no(check.get("weights_bitwise_equal")))),
    ]
    if check.get("resume_peak_allocated_bytes") is not None:
        # resume is where runs die a second time: the load's peak beside the training peak
        train_peak, resume_peak = check.get("training_peak_allocated_bytes"), check["resume_peak_allocated_bytes"]
        verdict = ""
        if isinstance(train_peak, (int, float)) and train_peak > 0:
            verdict = f" ({resume_peak / train_peak:.2f}x the training peak)"
        pairs += [
            ("device peak while loading the checkpoint", _e(_bytes(resume_peak) + verdict)),
            ("training peak (uninterrupted run)", _e(_bytes(train_peak))),
            ("host RSS after loading, largest rank", _e(_bytes(check.get("resume_host_rss_bytes")))),
            ("host RSS of training, largest rank", _e(_bytes(check.get("training_host_rss_bytes")))),
        ]
    src = f'<p class="muted">From <code>{_e(path)}</code>.</p>' if path else ""
    return banner + src + _kv(pairs)


def _yes_no(x: Any) -> str:
    if isinstance(x, bool):
        return "yes" if x else "no"
    return "—" if x is None else str(x)


def _data_identity(path: Path, stats: dict[str, Any]) -> tuple[str, str]:
    """(model, method) from `results/{model}/data/{method}/stats.json`, else what the file says."""
    method = str(stats.get("method") or path.parent.name)
    model = path.parent.parent.parent.name if path.parent.parent.name == "data" else "?"
    return model, method


def _data_section(path: Path, stats: dict[str, Any], anchor: str) -> str:
    model, method = _data_identity(path, stats)
    title = f"{model} · {method}"
    kept = stats.get("rows_kept") if isinstance(stats.get("rows_kept"), dict) else {}
    pairs = [
        ("source", f"<code>{_e(stats.get('source', '—'))}</code>"),
        ("max_len", _e(f"{_plain(stats.get('max_len'))} tokens")),
        ("rows read", _e(_plain(stats.get("rows_read")))),
        ("rows kept", _e(f"{_plain(kept.get('train'))} train, {_plain(kept.get('eval'))} eval")),
        ("tokens stored", _e(_plain(stats.get("tokens")))),
    ]
    out = [f'<h3 id="{anchor}">{_e(title)}</h3>', f'<p class="muted">From <code>{_e(path)}</code>.</p>', _kv(pairs)]
    for key, label in (("dropped", "rows dropped"), ("truncated", "rows truncated")):
        counts = stats.get(key) if isinstance(stats.get(key), dict) else {}
        if counts:
            total = sum(v for v in map(_num, counts.values()) if v is not None)
            rows = [[_e(reason), (_e(_plain(n)), "n")] for reason, n in counts.items()]
            out.append(f"<h4>{_e(label)}: {_e(_plain(total))}</h4>" + _table(["reason", "rows"], rows))
        else:
            out.append(f"<p>{_e(label)}: none reported.</p>")
    length = stats.get("length") if isinstance(stats.get("length"), dict) else {}
    if length:
        keys = [k for k in ("min", "mean", "p50", "p90", "p99", "max") if k in length]
        out.append("<h4>Row length (tokens, kept rows)</h4>" + _table(keys, [[(_e(_plain(length[k], 5)), "n") for k in keys]]))
        out.append(length_chart(stats, title))
    return "\n".join(out)
