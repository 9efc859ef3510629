"""The page's figures: matplotlib on the Agg canvas (no pyplot state), embedded as inline PNG.

Each chart returns a `Plot` (the image as a data: URI, its alt text, a note under it) or a
`Plot` holding only a message saying why there is no figure; the templates lay them out. The
charts of candidates read the run's rows of the candidate table (`memfit.results`, one record
per candidate: `RunOutputs.records`)."""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass
from typing import Any

from memfit.estimate.rows import Budget

from .fmt import _measured, _num, _unit_for
from .inputs import RunOutputs

MAX_BARS = 40  # candidates drawn per chart (the table lists all); best ranked first
BREAKDOWN = ("params", "grads", "optimizer", "activations", "logits", "reference", "temporaries", "overheads")


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


@dataclass(frozen=True)
class Plot:
    """A figure for the page (`src` a data: URI), or only `message` where there is none to draw."""

    alt: str = ""
    src: str = ""
    note: str = ""  # under the figure, muted
    message: str = ""  # instead of the figure


def _img(fig, alt: str, note: str = "") -> Plot:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight")
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return Plot(alt=alt, src=f"data:image/png;base64,{data}", note=note)


def _label(x: Any) -> str:
    return str(x).replace("$", r"\$")  # a `$` would start matplotlib mathtext


def _budget_lines(ax, budget: Budget, unit: int, uname: str) -> None:
    dev, head = float(budget.device_bytes), float(budget.headroom)
    limit = dev * (1.0 - head)
    ax.axvline(dev / unit, color="black", lw=1.2, label=f"device budget {dev / unit:.2f} {uname}")
    if head:
        ax.axvspan(limit / unit, dev / unit, color="tab:red", alpha=0.12, label=f"{head:.0%} headroom")
        ax.axvline(limit / unit, color="tab:red", lw=1.2, ls="--", label=f"usable {limit / unit:.2f} {uname}")


def _shown_of(run: RunOutputs) -> str:
    n = len(run.ranked)
    return f"Showing the {MAX_BARS} best ranked of {n} candidates; the table lists all." if n > MAX_BARS else ""


def _style_ticks(ax, rows: list[dict[str, Any]], selected_id: Any) -> None:
    """Candidate ids on the y axis, the selected one in bold green."""
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([_label(r["id"]) for r in rows], fontsize=7)
    for tick, r in zip(ax.get_yticklabels(), rows, strict=True):
        if r["id"] == selected_id:
            tick.set_fontweight("bold")
            tick.set_color("tab:green")
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)


def memory_chart(run: RunOutputs) -> Plot:
    """Predicted vs measured peak per candidate, against the budget and its headroom."""
    rows = run.ranked[:MAX_BARS]
    probes = [r for r in rows if r["probe_status"] is not None]
    if any(r["probe_peak_reserved_bytes"] is not None for r in probes):
        key, what = "peak_reserved_bytes", "peak reserved"
    elif probes:
        key, what = "peak_allocated_bytes", "peak allocated"
    else:
        key, what = "device_total_bytes", "device total (reserved + CUDA context)"
    pred = [_num(r[f"predicted_{key}"]) for r in rows]
    if key == "device_total_bytes":
        pred = [p if p is not None else _num(r["device_bytes"]) for p, r in zip(pred, rows, strict=True)]
    meas = [_num(_measured(r)[0]) if _measured(r)[1] in ("reserved", "allocated") else None for r in rows]
    budget = run.selection.budget
    if not any(v is not None for v in pred + meas):
        return Plot(message="No memory figures to draw.")
    unit, uname = _unit_for([*pred, *meas, budget.device_bytes])
    fig = _figure(9, 1.4 + 0.32 * len(rows))
    ax = fig.add_subplot()
    y = range(len(rows))
    ax.barh(
        [i - 0.2 for i in y],
        [(p or 0) / unit for p in pred],
        0.4,
        color="tab:blue",
        alpha=0.55,
        label=f"predicted {what}",
    )
    if probes:
        ax.barh(
            [i + 0.2 for i in y],
            [(m or 0) / unit for m in meas],
            0.4,
            color="tab:orange",
            label=f"measured {what} (probe)",
        )
    for i, r in enumerate(rows):
        status = _measured(r)[1]
        if status and status not in ("reserved", "allocated"):
            ax.text(0, i + 0.2, f" {status} in probe", va="center", fontsize=7, color="tab:red", fontweight="bold")
    _budget_lines(ax, budget, unit, uname)
    _style_ticks(ax, rows, run.selected_id)
    ax.set_xlabel(f"{what} per device ({uname})")
    ax.set_title(f"Memory per candidate: {run.title}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: bars reach the budget
    return _img(fig, f"memory per candidate, {run.title}", _shown_of(run))


def _component(r: dict[str, Any], comp: str) -> Any:
    return r.get(f"predicted_breakdown_{comp}_bytes")


def breakdown_chart(run: RunOutputs) -> Plot:
    """The estimator's predicted device memory per candidate, stacked by component."""
    if run.table is None:
        return Plot(message="No candidates.json beside selected.json: the predicted breakdown is not shown.")
    # rows of candidates.json (`invalid` is set from it), in the selection's ranking where there is one
    estimated = [r for r in run.records if r["invalid"] is not None]
    order = [r for r in estimated if r["rank"] is not None] or estimated
    rows = [r for r in order[:MAX_BARS] if any(_component(r, c) is not None for c in BREAKDOWN)]
    if not rows:
        return Plot(message="The candidate table has no breakdown to draw.")
    totals = [sum(v for v in (_num(_component(r, c)) for c in BREAKDOWN) if v is not None) for r in rows]
    budget = run.selection.budget
    unit, uname = _unit_for([*totals, budget.device_bytes])
    fig = _figure(9, 1.6 + 0.32 * len(rows))
    ax = fig.add_subplot()
    left = [0.0] * len(rows)
    colors = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c")
    for comp, color in zip(BREAKDOWN, colors, strict=True):
        vals = [(_num(_component(r, comp)) or 0.0) / unit for r in rows]
        if any(vals):
            ax.barh(range(len(rows)), vals, 0.7, left=left, color=color, label=comp)
            left = [a + b for a, b in zip(left, vals, strict=True)]
    # the probes' measured peaks over the predicted stacks: where the components under- or over-shoot
    meas = [_measured(r) if r["rank"] is not None else (None, "") for r in rows]
    pts = [
        (float(v) / unit, i) for i, (v, k) in enumerate(meas) if k in ("reserved", "allocated") and _num(v) is not None
    ]
    if pts:
        kinds = "/".join(sorted({k for _, k in meas if k in ("reserved", "allocated")}))
        ax.scatter(
            *zip(*pts, strict=True), marker="D", s=28, color="black", zorder=4, label=f"measured peak {kinds} (probe)"
        )
    _budget_lines(ax, budget, unit, uname)
    _style_ticks(ax, rows, run.selected_id)
    ax.set_xlabel(f"predicted device memory at the peak ({uname})")
    ax.set_title(f"Predicted breakdown: {run.title}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _img(fig, f"predicted memory breakdown per candidate, {run.title}", _shown_of(run))


# The training curves' panels: (title with unit, [(metrics key, series name)], y unit kind).
# Units: loss is the mean token cross-entropy in nats (SFT) or the method's loss (DPO -log σ(β·margin));
# rewards are DPO's and KTO's β·(log π - log π_ref) of the chosen/rejected completion (Rafailov et al.
# 2023, arXiv:2305.18290, eq. 7 and TRL's DPOTrainer logs), ORPO's and SimPO's β·mean log π (TRL's
# ORPOTrainer, CPOTrainer); a reward model logs its scores' pair accuracy and margin (TRL's
# RewardTrainer: `accuracy`, `margin`); ORPO its NLL and log σ(log odds ratio) (Hong et al. 2024,
# eq. 6); KTO its reference point z0 = KL(π‖π_ref) on the mismatched batch (Ethayarajh et al. 2024,
# eq. 4). tokens_per_s counts non-padding tokens of rank 0 (memfit.train.loop.Trainer.train_step);
# peaks are running maxima since the launch or resume.
CURVE_PANELS: tuple[tuple[str, tuple[tuple[str, str], ...], str], ...] = (
    ("loss", (("loss", "loss"),), ""),
    ("rewards (DPO, KTO: β·log π/π_ref; ORPO, SimPO: β·mean log π)", (("rewards/chosen", "chosen"), ("rewards/rejected", "rejected")), ""),
    ("reward accuracy (pairs ranked right)", (("rewards/accuracies", "accuracy"),), "fraction"),
    ("reward margin (chosen - rejected)", (("rewards/margins", "margin"),), ""),
    ("reward model: pair accuracy (chosen scored higher)", (("accuracy", "accuracy"),), "fraction"),
    ("reward model: score margin (chosen - rejected)", (("margin", "margin"),), ""),
    ("ORPO: NLL and log σ(log odds ratio)", (("nll_loss", "NLL"), ("log_odds_ratio", "log σ(odds ratio)")), "nats"),
    ("KTO: reference point z0 = KL(π‖π_ref)", (("kl", "z0"),), "nats"),
    ("policy log-prob per completion", (("logps/chosen", "chosen"), ("logps/rejected", "rejected")), "nats"),
    ("learning rate", (("lr", "lr"),), ""),
    ("gradient norm (global)", (("grad_norm", "grad norm"),), ""),
    ("throughput, rank 0 (non-padding tokens/s)", (("tokens_per_s", "tokens/s"),), "tok/s"),
    ("device memory: running peak, largest rank", (("peak_allocated_bytes", "allocated"), ("peak_reserved_bytes", "reserved")), "bytes"),
    ("host RSS: peak, largest rank", (("host_rss_bytes", "host RSS"),), "bytes"),
)  # fmt: skip
MARK_STYLE = {  # kind: (color, line style)
    "oom": ("tab:red", "-"),
    "fallback": ("tab:red", ":"),
    "resume": ("tab:blue", "--"),
    "resume-check": ("tab:purple", "-."),
}
MARK_NAMES = {"oom": "OOM", "fallback": "fallback: resumed", "resume": "resumed", "resume-check": "resume check"}


def curves_figure(metrics: list[dict[str, Any]], title: str, marks: list | None = None):
    """The training curves as a matplotlib Figure (None without loss values): one panel per
    metric the rows hold, eval points as dots, and `marks` (memfit.report.marks.Mark) as vertical
    lines on every panel, labelled on the first, with the steps an OOM made the run redo shaded."""
    train = [r for r in metrics if r.get("split", "train") == "train"]
    evals = [r for r in metrics if r.get("split") == "eval"]
    if not any(_num(r.get("loss")) is not None for r in metrics):
        return None
    panels = [p for p in CURVE_PANELS if any(_num(r.get(k)) is not None for r in metrics for k, _ in p[1])]
    # more panels a row as they grow (three from five, four from seven) across the page's full width
    # (1,200 px at 96 dpi): a DPO run's ten panels take three rows, not five
    cols = 4 if len(panels) >= 7 else 3 if len(panels) >= 5 else 2 if len(panels) > 1 else 1
    nrows = math.ceil(len(panels) / cols)
    fig = _figure({1: 6, 2: 9, 3: 12.5, 4: 12.5}[cols], (2.3 if cols == 4 else 2.5) * nrows + 0.4)
    marks = marks or []
    for i, (name, series, kind) in enumerate(panels):
        ax = fig.add_subplot(nrows, cols, i + 1)
        unit, uname = (1, kind)
        if kind == "bytes":
            unit, uname = _unit_for(r.get(k) for r in metrics for k, _ in series)
        for key, label in series:
            for rows, split in ((train, "train"), (evals, "eval")):
                pts = [(r["step"], _num(r.get(key)) / unit) for r in rows if _num(r.get(key)) is not None]
                if not pts:
                    continue
                many = len(series) > 1
                text = f"{label} ({split})" if many else split
                if split == "eval":  # eval points as dots (joined when there are several)
                    ax.plot(
                        *zip(*pts, strict=True), marker="o", ms=4, ls="-" if len(pts) > 1 else "", lw=0.8, label=text
                    )
                else:
                    ax.plot(*zip(*pts, strict=True), lw=1.1, label=text)
        for m in marks:
            color, ls = MARK_STYLE.get(m.kind, ("black", "--"))
            ax.axvline(m.step, color=color, ls=ls, lw=1.0, alpha=0.9)
            if m.redo_from is not None:
                ax.axvspan(m.redo_from, m.step, color="tab:red", alpha=0.08)
        if i == 0:
            _mark_labels(ax, marks)
            for kind in dict.fromkeys(m.kind for m in marks):  # the mark styles, explained in the first legend
                color, ls = MARK_STYLE.get(kind, ("black", "--"))
                ax.plot([], [], color=color, ls=ls, lw=1.0, label=MARK_NAMES.get(kind, kind))
        if kind == "bytes":
            ax.set_ylim(bottom=0)
        ax.set_xlabel("optimizer step", fontsize=8)
        ax.set_ylabel(uname, fontsize=8)
        ax.set_title(_label(name), fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(_label(title), fontsize=10)
    fig.tight_layout()
    return fig


def _mark_labels(ax, marks: list) -> None:
    """Each mark's short label, rotated along its line at the top of the panel; marks at one step share a label."""
    from matplotlib.transforms import blended_transform_factory

    by_step: dict[float, list] = {}
    for m in marks:
        by_step.setdefault(m.step, []).append(m)
    trans = blended_transform_factory(ax.transData, ax.transAxes)
    for step, ms in by_step.items():
        color = MARK_STYLE.get(ms[0].kind, ("black", "--"))[0]
        ax.text(step, 0.97, _label("\n".join(m.short for m in ms)), transform=trans, rotation=90, va="top", ha="right",
                fontsize=6.5, color=color, bbox={"facecolor": "white", "alpha": 0.7, "edgecolor": "none", "pad": 1})  # fmt: skip


def curves_chart(metrics: list[dict[str, Any]], title: str, marks: list | None = None) -> Plot:
    """Every logged metric over the steps, with eval points and the run's resume/OOM marks (see curves_figure)."""
    fig = curves_figure(metrics, title, marks)
    if fig is None:
        return Plot(message="The metrics file has no loss values to draw.")
    alt = f"training curves, {title}"
    if marks:
        alt += "; marked: " + ", ".join(m.short for m in marks)
    return _img(fig, alt)


def memory_compare_chart(
    figures: list[tuple[str, dict[str, Any]]],
    title: str,
    what: str = "Selected candidate memory",
    measured_from: int = 1,
    alt: str = "training peak vs probe peak",
) -> Plot | None:
    """Peak allocated and reserved of several figure sets (predicted, probe, training...), side by side."""
    # Only what was measured: a predicted reserved peak alone (the CPU reports none) compares nothing.
    measured = figures[measured_from:]
    kinds = [
        k
        for k in ("peak_allocated_bytes", "peak_reserved_bytes")
        if any(_num(f.get(k)) is not None for _, f in measured)
    ]
    if not kinds:
        return None
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


def length_chart(stats: dict[str, Any], title: str) -> Plot | None:
    length = stats.get("length") if isinstance(stats.get("length"), dict) else {}
    keys = [k for k in ("min", "p50", "p90", "p99", "max") if _num(length.get(k)) is not None]
    if not keys:
        return None
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


def accuracy_chart(run: RunOutputs) -> Plot | None:
    """Predicted vs measured peak per probed candidate, with the identity line: how far to trust
    the estimator on this hardware. Empty where nothing was measured (plan only)."""
    pts = []
    for r in run.ranked:
        value, kind = _measured(r)
        if kind not in ("reserved", "allocated"):
            continue
        # like with like: the probe's allocated peak against the predicted allocated peak, reserved against reserved
        pred = _num(r[f"predicted_peak_{kind}_bytes"])
        if pred is not None and _num(value) is not None:
            pts.append((pred, float(value), r["id"] == run.selected_id, kind))
    if not pts:
        return None
    unit, uname = _unit_for([v for p in pts for v in p[:2]])
    fig = _figure(5.2, 4.2)
    ax = fig.add_subplot()
    lo = min(min(p[0], p[1]) for p in pts) / unit * 0.9
    hi = max(max(p[0], p[1]) for p in pts) / unit * 1.1
    ax.plot([lo, hi], [lo, hi], color="black", lw=1, label="measured = predicted")
    for sel in (False, True):
        xs = [p[0] / unit for p in pts if p[2] == sel]
        ys = [p[1] / unit for p in pts if p[2] == sel]
        if xs:
            ax.scatter(
                xs,
                ys,
                s=40 if sel else 22,
                color="tab:green" if sel else "tab:orange",
                label="selected" if sel else "probed candidate",
                zorder=3,
            )
    kinds = sorted({p[3] for p in pts})
    ax.set_xlabel(f"predicted peak {'/'.join(kinds)} per device ({uname})")
    ax.set_ylabel(f"measured peak {'/'.join(kinds)} per device ({uname})")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_title(f"Predicted vs measured: {run.title}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    worst = max(abs(p[1] - p[0]) / p[1] for p in pts)
    note = f"{len(pts)} probed candidate(s); the largest miss is {worst:.0%} of the measured peak. Above the line: the estimator under-predicted."
    return _img(fig, f"predicted vs measured peak, {run.title}", note)
