"""Did two workflow runs decide and train the same? The "no behaviour change" check.

    memfit compare-results BASELINE/results NEW/results [--rtol 0]

For every run directory (`<model>/<gpu>/<method>`, found by its candidates.json) either tree
holds, it separates what must be equal from what was timed (issue #41):

Must be equal (each difference one line, exit 1):
- candidates.json: each candidate's prediction (fits, invalid, peak bytes, host bytes, and the
  step time where it was modelled) and which candidates were chosen for probing;
- probes/<id>.json: each probe's outcome (ok | oom | error | timeout);
- selected.json: the selected candidate, where both runs chose it by a margin beyond the
  measured noise (`decision` of memfit.estimate.selection);
- train/metrics.jsonl: the loss of every (step, split) row; train/model/*.safetensors: every
  weight tensor (max |a - b| within `--rtol` of the tensor's largest magnitude);
- verify_resume.json: the resume verdict (passed, steps compared, bitwise flags).

Reported, never a difference (lines starting "timing:"): measured step times, i.e. candidates.json
step times priced from a calibration (its `time_source` "measured ...") and the probes' step times,
each pair with its relative difference and the probe's own spread; and what follows from them: a
probe choice ranked by calibrated times, a selection within the measured noise (the tie rule's
band), and then the training of two different candidates, which is not compared.

Numbers must be equal, floats within `--rtol` (default 0: identical). A folder that is not there,
or a file that is not what the workflow writes, is bad input: exit 2 with the path, no traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

PREDICTION_KEYS = (
    "fits",
    "invalid",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "device_total_bytes",
    "host_bytes",
    "step_time_s",  # a timing where a calibration priced it (`_measured_time`)
)
TIMING = "timing: "  # the prefix of a reported timing line (never a difference)
VERDICT_KEYS = (
    "passed",
    "from_step",
    "final_step",
    "steps_compared",
    "missing_steps",
    "losses_bitwise_equal",
    "weights_bitwise_equal",
)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def same_value(a: Any, b: Any, rtol: float) -> bool:
    """Equal; a float within `rtol` of the other (relative to the larger magnitude). Bools, ints,
    strings and lists compare exactly; NaN equals NaN (both runs diverged the same way)."""
    if _is_number(a) and _is_number(b) and (isinstance(a, float) or isinstance(b, float)):
        return a == b or math.isclose(a, b, rel_tol=rtol) or (math.isnan(a) and math.isnan(b))
    return a == b


def run_dirs(root: Path) -> set[str]:
    """`<model>/<gpu>/<method>` of every run under `root` (each has a candidates.json)."""
    return {str(p.parent.relative_to(root)) for p in Path(root).rglob("candidates.json")}


def compare_trees(a: Path, b: Path, rtol: float = 0.0) -> list[str]:
    """Every difference between results trees `a` and `b`, one line each (empty: the same)."""
    return compare(a, b, rtol)[0]


def compare(a: Path, b: Path, rtol: float = 0.0) -> tuple[list[str], list[str]]:
    """(differences, timings): what must be equal and is not, and the measured timings reported."""
    a, b = Path(a), Path(b)
    for root in (a, b):
        if not root.is_dir():
            raise FileNotFoundError(f"{root}: not a directory")
    runs_a, runs_b = run_dirs(a), run_dirs(b)
    out = [f"{run}: only in {a}" for run in sorted(runs_a - runs_b)]
    out += [f"{run}: only in {b}" for run in sorted(runs_b - runs_a)]
    if not runs_a | runs_b:
        out.append(f"no runs (candidates.json) under {a} or {b}")
    notes: list[str] = []
    for run in sorted(runs_a & runs_b):
        diffs, timed = compare_run(a / run, b / run, run, rtol)
        out += diffs
        notes += timed
    return out, notes


def compare_run(a: Path, b: Path, name: str, rtol: float) -> tuple[list[str], list[str]]:
    out: list[str] = []
    notes: list[str] = []
    ca, cb = _candidate_facts(a / "candidates.json"), _candidate_facts(b / "candidates.json")
    timed_choice = ca.pop("_calibrated") and cb.pop("_calibrated", False)
    cb.pop("_calibrated", None)
    notes += _timing_summary(f"{name}/candidates.json", ca.pop("_times"), cb.pop("_times"))
    timed_choice = timed_choice and ca["probed"] != cb["probed"]
    if timed_choice:
        notes.append(
            f"{TIMING}{name}/candidates.json: probed {ca['probed']!r} vs {cb['probed']!r}: the probes are the fastest "
            "by calibrated (measured) step times, so they follow the timings above"
        )
        ca.pop("probed"), cb.pop("probed")
    out += _diff(f"{name}/candidates.json", ca, cb, rtol)
    pa, pb = _probes(a), _probes(b)
    outcomes = [set(pa), set(pb)] if not timed_choice else [set(pa) & set(pb)] * 2
    out += _diff(
        f"{name}/probes",
        {f"{i} status": pa[i]["status"] for i in outcomes[0]},
        {f"{i} status": pb[i]["status"] for i in outcomes[1]},
        rtol,
    )
    notes += _timing_pairs(
        f"{name}/probes",
        {i: p.get("step_time_s") for i, p in pa.items()},
        {i: p.get("step_time_s") for i, p in pb.items()},
        pa,
        pb,
    )
    same_training = True
    sa, sb = a / "selected.json", b / "selected.json"
    if sa.exists() != sb.exists():
        out.append(f"{name}/selected.json: only in {sa if sa.exists() else sb}")
    elif sa.exists():
        diff, note = _compare_selection(name, sa, sb, timed_choice)
        out += diff
        notes += note
        same_training = not diff and not note
    for rel, facts in (("verify_resume.json", _verdict_facts), ("train/metrics.jsonl", _loss_facts)):
        if rel.startswith("train/") and not same_training:
            continue
        fa, fb = a / rel, b / rel
        if not fa.exists() and not fb.exists():
            continue
        if fa.exists() != fb.exists():
            out.append(f"{name}/{rel}: only in {fa if fa.exists() else fb}")
            continue
        out += _diff(f"{name}/{rel}", facts(fa), facts(fb), rtol)
    if same_training:
        out += _compare_weights(name, a / "train" / "model", b / "train" / "model", rtol)
    else:
        notes.append(f"{TIMING}{name}/train: not compared: the runs trained different candidates (above)")
    return out, notes


def _compare_selection(name: str, sa: Path, sb: Path, timed_choice: bool) -> tuple[list[str], list[str]]:
    """([difference], []) when the selections differ though neither was a tie within the noise;
    ([], [timing note]) when one was (or the probes were chosen by calibrated times and differ);
    ([], []) when the same."""
    da, db = _read_json(sa), _read_json(sb)
    chosen = [_get(_get(d, "selected", p), "id", p) for d, p in ((da, sa), (db, sb))]
    if chosen[0] == chosen[1]:
        return [], []
    decisions = [(d["selected"].get("decision") or {}) for d in (da, db)]
    line = f"{name}/selected.json: selected: {chosen[0]!r} != {chosen[1]!r}"
    noisy = [d.get("by") == "tie rule" for d in decisions]
    if timed_choice:
        return [], [f"{TIMING}{line} among probes chosen by calibrated times (above); {_speeds(sa, sb)}"]
    if all(decisions) and any(noisy):
        why = "; ".join(f"{w} tree {_decided(d)}" for w, d in zip(("first", "second"), decisions, strict=True))
        return [], [f"{TIMING}{line} within the measured noise ({why}); {_speeds(sa, sb)}"]
    return [line, f"{name}/selected.json: {_speeds(sa, sb)}"], []


def _decided(d: dict[str, Any]) -> str:
    if not d:
        return "recorded no margin"
    if d.get("margin") is None:
        return f"by {d.get('by')}"
    return f"by {d.get('by')}, margin {d['margin']:+.1%} over {d.get('runner_up')}, noise {d.get('noise', 0):.0%}"


def _timing_pairs(
    where: str, ta: dict[str, Any], tb: dict[str, Any], pa: dict[str, Any], pb: dict[str, Any]
) -> list[str]:
    """One line per measured time in both trees that differs: both values, the relative
    difference and (probes) each run's own range of steady steps."""
    out = []
    for key in sorted(set(ta) & set(tb)):
        x, y = ta[key], tb[key]
        if not (_is_number(x) and _is_number(y)) or x == y:
            continue
        line = f"{TIMING}{where}: {key} step_time_s {x:.4g} vs {y:.4g} s ({(y - x) / x:+.1%})" if x else ""
        ranges = [_range(p.get(key, {})) for p in (pa, pb)]
        if any(ranges):
            line += f", steps ranged {ranges[0] or 'n/a'} and {ranges[1] or 'n/a'}"
        out.append(line + "; measured, not compared")
    return [line for line in out if line]


def _timing_summary(where: str, ta: dict[str, Any], tb: dict[str, Any]) -> list[str]:
    """One line for all calibrated step times of candidates.json: how many differ and the spread
    of their relative differences (median, smallest, largest)."""
    rel = sorted(
        (tb[k] - ta[k]) / ta[k]
        for k in set(ta) & set(tb)
        if _is_number(ta[k]) and _is_number(tb[k]) and ta[k] and ta[k] != tb[k]
    )
    if not rel:
        return []
    return [
        f"{TIMING}{where}: {len(rel)} of {len(set(ta) & set(tb))} calibrated step times differ, median "
        f"{rel[len(rel) // 2]:+.1%} (from {rel[0]:+.1%} to {rel[-1]:+.1%}); measured, not compared"
    ]


def _range(probe: dict[str, Any]) -> str:
    times = [t for t in probe.get("steady_step_times_s") or [] if _is_number(t)]
    return f"{min(times):.4g}-{max(times):.4g} s" if len(times) > 1 else ""


def _compare_weights(name: str, ma: Path, mb: Path, rtol: float) -> list[str]:
    """Every weight file of the trained models (train/model/*.safetensors): the same tensors, each
    within `rtol` (max |a - b| <= rtol x max |a|; 0: identical)."""
    fa = {p.name for p in ma.glob("*.safetensors")} if ma.is_dir() else set()
    fb = {p.name for p in mb.glob("*.safetensors")} if mb.is_dir() else set()
    out = [f"{name}/train/model/{f}: only in {ma if f in fa else mb}" for f in sorted(fa ^ fb)]
    for f in sorted(fa & fb):
        out += _tensor_diffs(f"{name}/train/model/{f}", ma / f, mb / f, rtol)
    return out


def _tensor_diffs(where: str, pa: Path, pb: Path, rtol: float) -> list[str]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(pa), "pt") as a, safe_open(str(pb), "pt") as b:
            ka, kb = set(a.keys()), set(b.keys())
            out = [f"{where}: tensor {k} only in {pa if k in ka else pb}" for k in sorted(ka ^ kb)]
            for k in sorted(ka & kb):
                x, y = a.get_tensor(k).double(), b.get_tensor(k).double()
                if x.shape != y.shape:
                    out.append(f"{where}: {k}: shape {tuple(x.shape)} != {tuple(y.shape)}")
                    continue
                worst = float((x - y).abs().max()) if x.numel() else 0.0
                scale = float(x.abs().max()) if x.numel() else 0.0
                if worst > rtol * scale:
                    out.append(f"{where}: {k}: max |difference| {worst:.3g} (largest value {scale:.3g}, rtol {rtol:g})")
            return out
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{where}: not a readable safetensors file ({e})") from None


def _diff(where: str, fa: dict[str, Any], fb: dict[str, Any], rtol: float) -> list[str]:
    out = []
    for key in sorted(set(fa) | set(fb)):
        if key not in fb:
            out.append(f"{where}: {key} only in the first tree ({fa[key]!r})")
        elif key not in fa:
            out.append(f"{where}: {key} only in the second tree ({fb[key]!r})")
        elif not same_value(fa[key], fb[key], rtol):
            out.append(f"{where}: {key}: {fa[key]!r} != {fb[key]!r}")
    return out


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from e


def _get(d: dict[str, Any], key: str, path: Path) -> Any:
    if key not in d:
        raise ValueError(f"{path}: no key {key!r}")
    return d[key]


def _measured_time(row: dict[str, Any]) -> bool:
    """Was this candidate's step time priced from a calibration (a measurement), not modelled?"""
    return str(row.get("time_source", "")).startswith("measured")


def _candidate_facts(path: Path) -> dict[str, Any]:
    """The must-equal facts of candidates.json, with `_times` (measured step times by id) and
    `_calibrated` (whether the ranking that chose the probes rests on measured times) aside."""
    table = _read_json(path)
    facts: dict[str, Any] = {"probed": sorted(_get(table, "probe", path)), "_times": {}, "_calibrated": False}
    for row in _get(table, "rows", path):
        cid = _get(row, "id", path)
        for k in PREDICTION_KEYS:
            if k == "step_time_s" and _measured_time(row):
                facts["_times"][cid] = row.get(k)
                facts["_calibrated"] = True
            else:
                facts[f"{cid}.{k}"] = row.get(k)
    return facts


def _speeds(fa: Path, fb: Path) -> str:
    """Why the selections may differ: both selected candidates' throughput in each tree (measured
    speeds vary between runs; two candidates within a few percent can swap places)."""
    chosen = [_get(_read_json(f), "selected", f)["id"] for f in (fa, fb)]
    parts = []
    for label, f in (("first", fa), ("second", fb)):
        rows = {r.get("id"): r for r in _read_json(f).get("candidates", [])}
        speeds = ", ".join(f"{cid} {_tok_s(rows.get(cid))}" for cid in dict.fromkeys(chosen))
        parts.append(f"{label} tree: {speeds}")
    return "tokens/s (" + "; ".join(parts) + ")"


def _tok_s(row: dict[str, Any] | None) -> str:
    if row is None or row.get("tokens_per_s") is None:
        return "n/a"
    return f"{row['tokens_per_s']:.0f} ({row.get('source', '?')})"


def _verdict_facts(path: Path) -> dict[str, Any]:
    verdict = _read_json(path)
    return {k: verdict.get(k) for k in VERDICT_KEYS}


def _loss_facts(path: Path) -> dict[str, Any]:
    facts = {}
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        try:
            facts[f"step {row['step']} {row['split']} loss"] = row["loss"]
        except KeyError as e:
            raise ValueError(f"{path}:{i}: no key {e}") from e
    return facts


def _probes(run: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for p in sorted((run / "probes").glob("*.json")):
        d = _read_json(p)
        _get(d, "status", p)
        out[p.stem] = d
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="memfit compare-results",
        description="Compare two results/ trees: selections, per-step losses, weights, resume verdicts "
        "(exit 1 on a difference); measured timings are reported, never a difference.",
    )
    ap.add_argument("first", type=Path, help="results directory (e.g. of the baseline)")
    ap.add_argument("second", type=Path, help="results directory to compare with it")
    ap.add_argument("--rtol", type=float, default=0.0, help="relative tolerance for floats (default 0: identical)")
    args = ap.parse_args(argv)
    if not (args.rtol >= 0 and math.isfinite(args.rtol)):
        print(f"memfit compare-results: --rtol {args.rtol}: must be a finite number >= 0", file=sys.stderr)
        return 2
    for root in (args.first, args.second):
        if not root.is_dir():
            what = "is not a folder" if root.exists() else "does not exist"
            print(
                f"memfit compare-results: {root} {what}: give two results/ folders of workflow runs "
                "(e.g. baseline/results results)",
                file=sys.stderr,
            )
            return 2
    try:
        diffs, timings = compare(args.first, args.second, args.rtol)
    except (ValueError, OSError) as e:
        print(f"memfit compare-results: {e}", file=sys.stderr)
        return 2
    for line in diffs + timings:
        print(line)
    n = len(run_dirs(args.first) & run_dirs(args.second))
    verdict = f"{len(diffs)} difference(s)" if diffs else "the same"
    timed = f" ({len(timings)} measured timing(s) reported, not compared)" if timings else ""
    print(f"{args.first} vs {args.second}: {n} run(s) compared, {verdict}{timed}", file=sys.stderr)
    return 1 if diffs else 0
