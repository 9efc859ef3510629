"""What ran, what was chosen and why, and whether it held: one self-contained HTML page.

`write_report` reads the workflow's JSON outputs (selected.json with candidates.json
beside it, train/summary.json with train/metrics.jsonl beside it, verify_resume.json,
the data stats.json files) and writes a single HTML file: inline CSS, plots as inline
PNG images (matplotlib's Agg canvas, no pyplot state), no script and no external URL,
so the page can be mailed or attached to a ticket as it is.

Every required input (the paths passed in) is read and checked before anything is
written, and the page goes to a temporary sibling that is renamed into place: a
malformed input raises `ReportError` naming the file and leaves the previous page (or
none) untouched. Files found beside the inputs (candidates.json, metrics.jsonl) are
optional: when missing or unreadable the page says so and goes on.
"""

from __future__ import annotations

import base64
import datetime
import html
import io
import json
import math
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit import __version__

GiB = 2**30
MiB = 2**20
MAX_BARS = 40  # candidates drawn per chart (the table lists all); best ranked first
BREAKDOWN = ("params", "grads", "optimizer", "activations", "logits", "reference", "temporaries", "overheads")
DPO_CURVES = ("rewards/accuracies", "rewards/margins")


class ReportError(ValueError):
    """A report input that cannot be read; the message starts with the file's path."""


# --------------------------------------------------------------------------- inputs
@dataclass
class Run:
    """One (model, gpu, method) run directory and what was found for it."""

    path: Path  # selected.json
    sel: dict[str, Any]
    table: dict[str, Any] | None = None  # candidates.json beside selected.json
    summary: dict[str, Any] | None = None
    summary_path: Path | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    resume: dict[str, Any] | None = None
    resume_path: Path | None = None
    notes: list[str] = field(default_factory=list)  # what could not be read, said on the page

    @property
    def rows(self) -> list[dict[str, Any]]:
        rows = [r for r in self.sel.get("candidates") or [] if isinstance(r, dict)]
        sel = self.selected
        if sel and not any(r.get("id") == sel.get("id") for r in rows):
            rows.insert(0, sel)
        return rows

    @property
    def selected(self) -> dict[str, Any] | None:
        s = self.sel.get("selected")
        return s if isinstance(s, dict) else None

    @property
    def title(self) -> str:
        return " · ".join(str(self.sel.get(k) or "?") for k in ("model", "gpu", "method"))


def write_report(
    selected: Iterable[str | os.PathLike] | str | os.PathLike,
    summaries: Iterable[str | os.PathLike] | str | os.PathLike | None,
    resume: Iterable[str | os.PathLike] | str | os.PathLike | None,
    data_stats: Iterable[str | os.PathLike] | str | os.PathLike | None,
    out_html: str | os.PathLike,
) -> Path:
    """Write the report page to `out_html` atomically; return its path.

    `summaries` and `resume` are matched to runs by directory
    (`<run>/train/summary.json`, `<run>/verify_resume.json`); any that match no run are
    still shown, under "Inputs not matched to a run", so a failed check is never hidden.
    """
    runs = [_load_run(Path(p)) for p in _paths(selected)]
    by_dir = {_key(r.path.parent): r for r in runs}
    loose_summaries, loose_resume = [], []
    for p in map(Path, _paths(summaries)):
        summary = _read_json(p, "training summary")
        run = by_dir.get(_key(p.parent.parent))
        if run is None:
            loose_summaries.append((p, summary, *_read_metrics(p.parent / "metrics.jsonl")))
            continue
        run.summary, run.summary_path = summary, p
        run.metrics, skipped = _read_metrics(p.parent / "metrics.jsonl")
        run.notes += skipped
    for p in map(Path, _paths(resume)):
        check = _read_json(p, "resume check")
        run = by_dir.get(_key(p.parent))
        if run is None:
            loose_resume.append((p, check))
        else:
            run.resume, run.resume_path = check, p
    stats = [(Path(p), _read_json(Path(p), "data stats")) for p in _paths(data_stats)]
    page = _page(runs, stats, loose_summaries, loose_resume)
    out = Path(out_html)
    _write_atomic(out, page)
    return out


def _paths(x: Any) -> list[Any]:
    if x is None:
        return []
    if isinstance(x, (str, os.PathLike)):
        return [x]
    return list(x)


def _key(p: Path) -> str:
    return str(p.resolve())


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ReportError(f"{path}: {what} does not exist") from None
    except OSError as e:
        raise ReportError(f"{path}: cannot read {what}: {e}") from e
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: {what} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ReportError(f"{path}: {what} must be a JSON object, got {type(obj).__name__}")
    return obj


def _load_run(path: Path) -> Run:
    sel = _read_json(path, "selection (selected.json)")
    cands = sel.get("candidates")
    if cands is not None and not (isinstance(cands, list) and all(isinstance(r, dict) for r in cands)):
        raise ReportError(f"{path}: 'candidates' must be a list of objects")
    if sel.get("selected") is not None and not isinstance(sel["selected"], dict):
        raise ReportError(f"{path}: 'selected' must be an object")
    run = Run(path=path, sel=sel)
    table_path = path.parent / "candidates.json"
    if table_path.exists():
        try:
            run.table = _read_json(table_path, "candidate table")
        except ReportError as e:
            run.notes.append(f"predicted breakdown not shown: {e}")
    return run


def _read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Metric rows by (step, split), the last one winning; unreadable lines are counted, not fatal."""
    if not path.exists():
        return [], [f"{path}: no metrics file, so no training curves"]
    rows: dict[tuple[Any, Any], dict[str, Any]] = {}
    bad = 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(r, dict) and _num(r.get("step")) is not None:
            rows[(r["step"], r.get("split", "train"))] = r
        else:
            bad += 1
    notes = [f"{path}: {bad} line(s) could not be read and are left out of the curves"] if bad else []
    return sorted(rows.values(), key=lambda r: r["step"]), notes


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------- formatting
def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


def _bytes(b: Any, unit: int | None = None) -> str:
    v = _num(b)
    if v is None:
        return "—"
    unit = unit or (GiB if abs(v) >= GiB else MiB)
    return f"{v / GiB:.2f} GiB" if unit == GiB else f"{v / MiB:.1f} MiB"


def _secs(s: Any) -> str:
    v = _num(s)
    if v is None:
        return "—"
    return f"{v:.3f} s" if v < 10 else f"{v:.1f} s"


def _tps(x: Any) -> str:
    v = _num(x)
    if v is None:
        return "—"
    return f"{v:,.1f} tok/s" if v < 100 else f"{v:,.0f} tok/s"


def _plain(x: Any, digits: int = 4) -> str:
    v = _num(x)
    if v is None:
        return "—" if x is None else str(x)
    return f"{int(v):,}" if v.is_integer() and abs(v) < 1e15 else f"{v:.{digits}g}"


def _unit_for(values: Iterable[Any]) -> tuple[int, str]:
    nums = [abs(v) for v in map(_num, values) if v is not None]
    return (GiB, "GiB") if nums and max(nums) >= GiB else (MiB, "MiB")


def describe(cand: dict[str, Any], method: str | None = None, world_size: Any = None) -> str:
    """The configuration in words, e.g. 'ZeRO-3, optimizer offload to CPU (not pinned), ...'."""
    c = cand or {}
    parts = [f"ZeRO-{c['zero']}" if "zero" in c else "ZeRO stage unknown"]
    offload = []
    if c.get("offload_optimizer", "none") != "none":
        ratio = _num(c.get("offload_ratio"))
        ratio_txt = f", {ratio:.0%} of the optimizer states" if ratio is not None and ratio != 1.0 else ""
        offload.append(f"optimizer offload to {str(c['offload_optimizer']).upper()}{ratio_txt}")
    if c.get("offload_param", "none") != "none":
        offload.append(f"parameter offload to {str(c['offload_param']).upper()}")
    if offload:
        pin = "pinned host memory" if c.get("pin_memory") else "not pinned"
        parts.append(" and ".join(offload) + f" ({pin})")
    else:
        parts.append("no offload")
    if "grad_ckpt" in c:
        parts.append("gradient checkpointing" if c["grad_ckpt"] else "no gradient checkpointing")
    attn = {"flash": "FlashAttention-2", "sdpa": "SDPA attention", "eager": "eager attention"}
    if "attn" in c:
        parts.append(attn.get(c["attn"], f"{c['attn']} attention"))
    ft = c.get("finetune")
    if ft == "full":
        parts.append("full fine-tuning")
    elif ft:
        parts.append(f"{'LoRA' if ft == 'lora' else 'QLoRA'} rank {c.get('lora_rank', '?')}")
    mb, ga = c.get("micro_batch"), c.get("grad_accum")
    batch = f"micro batch {mb if mb is not None else '?'} × grad accum {ga if ga is not None else '?'}"
    w, m, g = _num(world_size), _num(mb), _num(ga)
    if w and m and g:
        batch += f" × {int(w)} rank{'s' if w != 1 else ''} = {int(w * m * g)} rows per step"
    parts.append(batch)
    if c.get("seq_len") is not None:
        parts.append(f"seq len {_plain(c['seq_len'])} tokens")
    if c.get("precision"):
        parts.append(str(c["precision"]))
    if method == "dpo" and c.get("ref"):
        ref = {"model": "frozen reference model", "adapter": "reference = model with the adapter disabled", "precomputed": "precomputed reference log-probs"}
        parts.append(ref.get(c["ref"], f"reference {c['ref']}"))
    return ", ".join(parts)


def _measured(row: dict[str, Any]) -> tuple[Any, str]:
    """The probe's peak as selection judges it (reserved on a GPU, allocated on the CPU)."""
    probe = row.get("probe")
    if not isinstance(probe, dict):
        return None, ""
    if probe.get("status") not in (None, "ok"):
        return None, str(probe.get("status")).upper()
    if probe.get("peak_reserved_bytes") is not None:
        return probe["peak_reserved_bytes"], "reserved"
    return probe.get("peak_allocated_bytes"), "allocated"


def _verdict(row: dict[str, Any], selected_id: Any) -> tuple[str, str]:
    """(text, css class) for the selection table."""
    probe = row.get("probe") if isinstance(row.get("probe"), dict) else {}
    if row.get("id") == selected_id:
        return "selected", "ok"
    if probe.get("status") not in (None, "ok"):
        return f"probe {probe['status']}", "bad"
    if row.get("source") == "rule":
        return "cannot run", "bad"
    if row.get("fits"):
        return "fits, not chosen", ""
    if row.get("fits") is False:
        return "does not fit", "bad"
    return "unknown", ""


# --------------------------------------------------------------------------- plots
def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def _img(fig, alt: str) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight")
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<img class="plot" alt="{_e(alt)}" src="data:image/png;base64,{data}">'


def _label(x: Any) -> str:
    return str(x).replace("$", r"\$")  # a `$` would start matplotlib mathtext


def _budget_lines(ax, budget: dict[str, Any], unit: int, uname: str) -> None:
    dev, head = _num(budget.get("device_bytes")), _num(budget.get("headroom")) or 0.0
    if dev is None:
        return
    limit = dev * (1.0 - head)
    ax.axvline(dev / unit, color="black", lw=1.2, label=f"device budget {dev / unit:.2f} {uname}")
    if head:
        ax.axvspan(limit / unit, dev / unit, color="tab:red", alpha=0.12, label=f"{head:.0%} headroom")
        ax.axvline(limit / unit, color="tab:red", lw=1.2, ls="--", label=f"usable {limit / unit:.2f} {uname}")


def _bar_rows(run: Run) -> list[dict[str, Any]]:
    return run.rows[:MAX_BARS]


def _shown_of(run: Run) -> str:
    n = len(run.rows)
    return f'<p class="muted">Showing the {MAX_BARS} best ranked of {n} candidates; the table lists all.</p>' if n > MAX_BARS else ""


def _style_ticks(ax, rows: list[dict[str, Any]], selected_id: Any) -> None:
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([_label(r.get("id", "?")) for r in rows], fontsize=7)
    for tick, r in zip(ax.get_yticklabels(), rows, strict=True):
        if r.get("id") == selected_id:
            tick.set_fontweight("bold")
            tick.set_color("tab:green")
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)


def memory_chart(run: Run) -> str:
    """Predicted vs measured peak per candidate, against the budget and its headroom."""
    rows = _bar_rows(run)
    probes = [r["probe"] for r in rows if isinstance(r.get("probe"), dict)]
    if any(p.get("peak_reserved_bytes") is not None for p in probes):
        key, what = "peak_reserved_bytes", "peak reserved"
    elif probes:
        key, what = "peak_allocated_bytes", "peak allocated"
    else:
        key, what = "device_total_bytes", "device total (reserved + CUDA context)"
    pred = [_num((r.get("predicted") or {}).get(key)) for r in rows]
    if key == "device_total_bytes":
        pred = [p if p is not None else _num(r.get("device_bytes")) for p, r in zip(pred, rows, strict=True)]
    meas = [_num(_measured(r)[0]) if _measured(r)[1] in ("reserved", "allocated") else None for r in rows]
    budget = run.sel.get("budget") or {}
    if not any(v is not None for v in pred + meas):
        return "<p>No memory figures to draw.</p>"
    unit, uname = _unit_for([*pred, *meas, budget.get("device_bytes")])
    fig = _figure(9, 1.4 + 0.32 * len(rows))
    ax = fig.add_subplot()
    y = range(len(rows))
    ax.barh([i - 0.2 for i in y], [(p or 0) / unit for p in pred], 0.4, color="tab:blue", alpha=0.55, label=f"predicted {what}")
    if probes:
        ax.barh([i + 0.2 for i in y], [(m or 0) / unit for m in meas], 0.4, color="tab:orange", label=f"measured {what} (probe)")
    for i, r in enumerate(rows):
        status = _measured(r)[1]
        if status and status not in ("reserved", "allocated"):
            ax.text(0, i + 0.2, f" {status} in probe", va="center", fontsize=7, color="tab:red", fontweight="bold")
    _budget_lines(ax, budget, unit, uname)
    _style_ticks(ax, rows, (run.selected or {}).get("id"))
    ax.set_xlabel(f"{what} per device ({uname})")
    ax.set_title(f"Memory per candidate: {run.title}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: bars reach the budget
    return _img(fig, f"memory per candidate, {run.title}") + _shown_of(run)


def breakdown_chart(run: Run) -> str:
    """The estimator's predicted device memory per candidate, stacked by component."""
    if run.table is None:
        return "<p>No candidates.json beside selected.json: the predicted breakdown is not shown.</p>"
    by_id = {r.get("id"): r for r in run.table.get("rows") or [] if isinstance(r, dict)}
    order = [r.get("id") for r in run.rows if r.get("id") in by_id] or list(by_id)
    rows = [by_id[i] for i in order[:MAX_BARS] if isinstance(by_id[i].get("breakdown"), dict)]
    if not rows:
        return "<p>The candidate table has no breakdown to draw.</p>"
    totals = [sum(v for v in map(_num, r["breakdown"].values()) if v is not None) for r in rows]
    budget = run.sel.get("budget") or run.table.get("budget") or {}
    unit, uname = _unit_for([*totals, budget.get("device_bytes")])
    fig = _figure(9, 1.6 + 0.32 * len(rows))
    ax = fig.add_subplot()
    left = [0.0] * len(rows)
    colors = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c")
    for comp, color in zip(BREAKDOWN, colors, strict=True):
        vals = [(_num(r["breakdown"].get(comp)) or 0.0) / unit for r in rows]
        if any(vals):
            ax.barh(range(len(rows)), vals, 0.7, left=left, color=color, label=comp)
            left = [a + b for a, b in zip(left, vals, strict=True)]
    _budget_lines(ax, budget, unit, uname)
    _style_ticks(ax, rows, (run.selected or {}).get("id"))
    ax.set_xlabel(f"predicted device memory at the peak ({uname})")
    ax.set_title(f"Predicted breakdown: {run.title}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _img(fig, f"predicted memory breakdown per candidate, {run.title}") + _shown_of(run)


def curves_chart(metrics: list[dict[str, Any]], title: str) -> str:
    """Loss (train and eval), DPO reward accuracy and margin, and peak memory per step."""
    train = [r for r in metrics if r.get("split", "train") == "train"]
    evals = [r for r in metrics if r.get("split") == "eval"]
    panels = [("loss", "loss")]
    panels += [(k, k) for k in DPO_CURVES if any(_num(r.get(k)) is not None for r in metrics)]
    mem = any(_num(r.get("peak_allocated_bytes")) is not None for r in train)
    if not any(_num(r.get("loss")) is not None for r in metrics):
        return "<p>The metrics file has no loss values to draw.</p>"
    n = len(panels) + (1 if mem else 0)
    cols = 2 if n > 1 else 1
    nrows = math.ceil(n / cols)
    fig = _figure(9 if cols == 2 else 6, 3.0 * nrows)
    for i, (key, label) in enumerate(panels):
        ax = fig.add_subplot(nrows, cols, i + 1)
        for rows, name, style in ((train, "train", "-"), (evals, "eval", "o-")):
            pts = [(r["step"], _num(r.get(key))) for r in rows if _num(r.get(key)) is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), style, ms=4, lw=1.2, label=name)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(label)
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if mem:
        ax = fig.add_subplot(nrows, cols, n)
        unit, uname = _unit_for(r.get("peak_allocated_bytes") for r in train)
        for key, name in (("peak_allocated_bytes", "allocated"), ("peak_reserved_bytes", "reserved")):
            pts = [(r["step"], _num(r.get(key)) / unit) for r in train if _num(r.get(key)) is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), lw=1.2, label=f"peak {name}")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(uname)
        ax.set_title(f"device memory peak per step ({uname}, largest rank)", fontsize=9)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(_label(title), fontsize=10)
    fig.tight_layout()
    return _img(fig, f"training curves, {title}")


def memory_compare_chart(figures: list[tuple[str, dict[str, Any]]], title: str, what: str = "Selected candidate memory", measured_from: int = 1, alt: str = "training peak vs probe peak") -> str:
    """Peak allocated and reserved of several figure sets (predicted, probe, training...), side by side."""
    # Only what was measured: a predicted reserved peak alone (the CPU reports none) compares nothing.
    measured = figures[measured_from:]
    kinds = [k for k in ("peak_allocated_bytes", "peak_reserved_bytes") if any(_num(f.get(k)) is not None for _, f in measured)]
    if not kinds:
        return ""
    unit, uname = _unit_for(f.get(k) for _, f in figures for k in kinds)
    fig = _figure(6, 2.8)
    ax = fig.add_subplot()
    width = 0.8 / len(figures)
    for j, (name, f) in enumerate(figures):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(kinds))]
        ax.bar(xs, [(_num(f.get(k)) or 0) / unit for k in kinds], width, label=name)
    ax.set_xticks(range(len(kinds)))
    ax.set_xticklabels([k.replace("_bytes", "").replace("_", " ") for k in kinds])
    ax.set_ylabel(uname)
    ax.set_title(_label(f"{what}: {title}"), fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    return _img(fig, f"{alt}, {title}")


def length_chart(stats: dict[str, Any], title: str) -> str:
    length = stats.get("length") if isinstance(stats.get("length"), dict) else {}
    keys = [k for k in ("min", "p50", "p90", "p99", "max") if _num(length.get(k)) is not None]
    if not keys:
        return ""
    fig = _figure(5.5, 2.6)
    ax = fig.add_subplot()
    ax.bar(keys, [_num(length[k]) for k in keys], color="tab:blue", alpha=0.7)
    if _num(length.get("mean")) is not None:
        ax.axhline(length["mean"], color="tab:green", lw=1, label=f"mean {length['mean']:.1f}")
    if _num(stats.get("max_len")) is not None:
        ax.axhline(stats["max_len"], color="tab:red", ls="--", lw=1, label=f"max_len {stats['max_len']}")
    ax.set_ylabel("tokens per row")
    ax.set_title(_label(f"Row length: {title}"), fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    return _img(fig, f"length distribution, {title}")


# --------------------------------------------------------------------------- HTML
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
.muted { color: #666; } img.plot { max-width: 100%; display: block; margin: 0.6em 0; }
.note { color: #8a5a00; }
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


def _page(runs: list[Run], stats: list[tuple[Path, dict[str, Any]]], loose_summaries: list, loose_resume: list) -> str:
    def distinct(key: str) -> str:
        vals = list(dict.fromkeys(str(r.sel.get(key)) for r in runs if r.sel.get(key) is not None))
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
    for i, run in enumerate(runs):
        body.append(_run_section(run, i, data_anchor.get((str(run.sel.get("model")), str(run.sel.get("method"))))))
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
    body.append("<h2>Data</h2>")
    if not stats:
        body.append("<p>No data statistics were given (plan only, or data not prepared).</p>")
    for i, (p, s) in enumerate(stats):
        body.append(_data_section(p, s, f"data-{i}"))
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>memfit report: {_e(distinct('model'))}</title><style>{CSS}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def _overview(runs: list[Run]) -> str:
    if not runs:
        return "<p>No runs were given.</p>"
    rows = []
    for i, run in enumerate(runs):
        s = run.selected or {}
        status, cls = _resume_status(run.resume)
        trained = "plan only" if run.sel.get("plan_only") else ("trained" if run.summary else "no training summary")
        rows.append([
            f'<a href="#run-{i}">{_e(run.title)}</a>',
            f"<code>{_e(s.get('id', 'none'))}</code>",
            (_bytes(s.get("device_bytes")), "n"),
            _e(s.get("source", "—")),
            (_tps(s.get("tokens_per_s")), "n"),
            _e(trained),
            (_e(status), cls),
        ])
    return "<h2>Runs</h2>" + _table(["run (model · GPU · method)", "selected candidate", "device peak", "judged on", "throughput", "training", "resume check"], rows)


def _run_section(run: Run, i: int, data_anchor: str | None) -> str:
    sel = run.sel
    s = run.selected
    method = sel.get("method")
    world = (run.summary or {}).get("world_size") or (run.table or {}).get("world_size")
    out = [f'<h2 id="run-{i}">{_e(run.title)}</h2>', f'<p class="muted">From <code>{_e(run.path)}</code>.</p>']
    if sel.get("plan_only"):
        out.append('<div class="banner info">Plan only: no probe ran and nothing was trained; the selection rests on predictions for hardware that is not here.</div>')
    out.append(_notes(run.notes))
    out.append("<h3>Selected configuration</h3>")
    if s is None:
        out.append('<p class="bad">No candidate was selected.</p>')
    else:
        out.append(f"<p><code>{_e(s.get('id', '?'))}</code>: {_e(describe(s.get('candidate') or {}, method, world))}.</p>")
        source = s.get("source", "?")
        out.append(
            f"<p>Chosen on {_e(source)} figures: device peak {_e(_bytes(s.get('device_bytes')))}, "
            f"host {_e(_bytes(s.get('host_bytes')))} per node, step time {_e(_secs(s.get('step_time_s')))}, "
            f"throughput {_e(_tps(s.get('tokens_per_s')))}.</p>"
        )
        est_notes = ((run.table and {r.get("id"): r for r in run.table.get("rows") or [] if isinstance(r, dict)}.get(s.get("id"))) or {}).get("notes")
        if isinstance(est_notes, list) and est_notes:
            out.append("<p>Estimator notes:</p><ul>" + "".join(f"<li>{_e(n)}</li>" for n in est_notes) + "</ul>")
    b = sel.get("budget") or {}
    dev, head = _num(b.get("device_bytes")), _num(b.get("headroom"))
    if dev is not None:
        usable = f", {head:.0%} headroom kept free: {_bytes(dev * (1 - head))} usable" if head else ""
        out.append(f"<p>Budget: {_e(_bytes(dev))} per device{_e(usable)}; host RAM {_e(_bytes(b.get('host_bytes')))} per node.</p>")
    if sel.get("launch"):
        out.append(f"<p>Launch command:</p><pre><code>{_e(sel['launch'])}</code></pre>")
    if data_anchor:
        out.append(f'<p>Data: <a href="#{data_anchor}">statistics for {_e(sel.get("model"))} · {_e(method)}</a>.</p>')

    out.append("<h3>Selection: every candidate</h3>")
    out.append(_selection_table(run))
    out.append("<h3>Memory per candidate</h3>")
    out.append(
        '<p class="muted">Predicted vs measured peak per device; the black line is the device budget, the red band the '
        "headroom kept free. With probes the bars compare like with like (peak reserved on a GPU, peak allocated on the CPU); "
        f"without, the prediction is the device total selection judges. At most {MAX_BARS} candidates, best ranked first.</p>"
    )
    out.append(memory_chart(run))
    out.append("<h3>Predicted memory breakdown</h3>")
    if (run.table or {}).get("estimator"):
        out.append(f'<p class="muted">Predicted by {_e(run.table["estimator"])}.</p>')
    out.append(breakdown_chart(run))

    out.append("<h3>Training</h3>")
    if run.summary is None:
        out.append("<p>Not trained: plan only.</p>" if sel.get("plan_only") else "<p>No training summary was given for this run.</p>")
    else:
        out.append(f'<p class="muted">From <code>{_e(run.summary_path)}</code>.</p>')
        out.append(_training_table(run.summary, run.metrics))
        out.append(_memory_compare(run))
        out.append(_reference_compare(run))
        if run.metrics:
            out.append(curves_chart(run.metrics, run.title))
    out.append("<h3>Resume check</h3>")
    if run.resume is None:
        out.append("<p>Not run: plan only.</p>" if sel.get("plan_only") else "<p>No resume check was given for this run.</p>")
    else:
        out.append(_resume_block(run.resume, run.resume_path))
    return "\n".join(out)


def _selection_table(run: Run) -> str:
    rows = run.rows
    if not rows:
        return "<p>selected.json lists no candidates.</p>"
    sid = (run.selected or {}).get("id")
    cells, classes = [], []
    for rank, r in enumerate(rows, 1):
        pred = r.get("predicted") or {}
        value, kind = _measured(r)
        if kind in ("reserved", "allocated"):
            measured = (f"{_e(_bytes(value))} <span class='muted'>{_e(kind)}</span>", "n")
        elif kind:
            measured = (_e(kind), "n bad")
        else:
            measured = ("not probed", "n muted")
        verdict, vcls = _verdict(r, sid)
        # A row judged without figures of its own (probe failed, cannot run) shows the prediction, marked.
        step = _or_predicted(r.get("step_time_s"), pred.get("step_time_s"), _secs)
        host = _or_predicted(r.get("host_bytes"), pred.get("host_bytes"), _bytes)
        cells.append([
            (str(rank), "n"),
            f"<code>{_e(r.get('id', '?'))}</code>",
            (_e(_bytes(pred.get("device_total_bytes"))), "n"),
            measured,
            (_e(host), "n"),
            (_e(step), "n"),
            (_e(_tps(r.get("tokens_per_s"))), "n"),
            _e(r.get("source", "—")),
            (_e(verdict), vcls),
            _e(r.get("reason") or "—"),
        ])
        classes.append("selected" if r.get("id") == sid else "")
    header = ["#", "candidate", "predicted device total", "measured peak (probe)", "host per node", "step time", "throughput", "judged on", "verdict", "reason"]
    return _table(header, cells, classes)


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


def _memory_compare(run: Run) -> str:
    """Training peak vs the probe's and the prediction's, for the selected candidate."""
    s = run.selected or {}
    pred = s.get("predicted") or {}
    probe = s.get("probe") if isinstance(s.get("probe"), dict) else None
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
    elif probe is None and not run.sel.get("plan_only"):
        out.append('<p class="muted">The selected candidate has no probe figures to compare with.</p>')
    out.append(memory_compare_chart(figures, run.title))
    return "\n".join(out)


def _reference_compare(run: Run) -> str:
    """DPO: the same candidate probed without and with a reference model in memory."""
    pair = (run.table or {}).get("reference_compare")
    if run.sel.get("method") != "dpo" or not isinstance(pair, dict):
        return ""
    by_id = {r.get("id"): r for r in run.rows}
    out = ["<h4>DPO reference: what keeping no reference model saves</h4>"]
    figures, rows, peaks = [], [], {}
    for mode, cid in pair.items():
        row = by_id.get(cid) or {}
        probe = row.get("probe") if isinstance(row.get("probe"), dict) else {}
        ok = probe.get("status", "missing") == "ok"
        peak = probe.get("peak_allocated_bytes") if ok else None
        status = "ok" if ok else str(probe.get("status", "not probed"))
        rows.append([f"<code>ref: {_e(mode)}</code>", f"<code>{_e(cid)}</code>", (_e(_bytes(peak)), "n"), (_e(_bytes(probe.get("peak_reserved_bytes") if ok else None)), "n"), (_e(_bytes((row.get("predicted") or {}).get("device_total_bytes"))), "n"), (_e(status), "n" if ok else "n bad")])
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
