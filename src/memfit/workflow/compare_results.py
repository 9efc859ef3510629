"""Did two workflow runs decide and train the same? The "no behaviour change" check.

    memfit compare-results BASELINE/results NEW/results [--rtol 0]

For every run directory (`<model>/<gpu>/<method>`, found by its candidates.json) either tree
holds, compares what a change of code must not change:

- candidates.json: each candidate's prediction (fits, invalid, peak bytes, host bytes,
  predicted step time) and which candidates were chosen for probing;
- probes/<id>.json: each probe's outcome (ok | oom | error | timeout);
- selected.json: the selected candidate;
- train/metrics.jsonl: the loss of every (step, split) row;
- verify_resume.json: the resume verdict (passed, steps compared, bitwise flags).

Numbers must be equal, floats within `--rtol` (default 0: identical). Measured times and
memory are not compared (they vary between two runs of the same code), except as they
decide the selection. Prints one line per difference and exits 1; 0 when none.
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
    "step_time_s",
)
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
    a, b = Path(a), Path(b)
    for root in (a, b):
        if not root.is_dir():
            raise FileNotFoundError(f"{root}: not a directory")
    runs_a, runs_b = run_dirs(a), run_dirs(b)
    out = [f"{run}: only in {a}" for run in sorted(runs_a - runs_b)]
    out += [f"{run}: only in {b}" for run in sorted(runs_b - runs_a)]
    if not runs_a | runs_b:
        out.append(f"no runs (candidates.json) under {a} or {b}")
    for run in sorted(runs_a & runs_b):
        out += compare_run(a / run, b / run, run, rtol)
    return out


def compare_run(a: Path, b: Path, name: str, rtol: float) -> list[str]:
    out = []
    for rel, facts in (
        ("candidates.json", _candidate_facts),
        ("selected.json", _selection_facts),
        ("verify_resume.json", _verdict_facts),
        ("train/metrics.jsonl", _loss_facts),
    ):
        fa, fb = a / rel, b / rel
        if not fa.exists() and not fb.exists():
            continue
        if fa.exists() != fb.exists():
            out.append(f"{name}/{rel}: only in {fa if fa.exists() else fb}")
            continue
        diffs = _diff(f"{name}/{rel}", facts(fa), facts(fb), rtol)
        if diffs and rel == "selected.json":
            diffs.append(f"{name}/{rel}: {_speeds(fa, fb)}")
        out += diffs
    probes_a, probes_b = _probe_outcomes(a), _probe_outcomes(b)
    out += _diff(f"{name}/probes", probes_a, probes_b, rtol)
    return out


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


def _candidate_facts(path: Path) -> dict[str, Any]:
    table = _read_json(path)
    facts: dict[str, Any] = {"probed": sorted(_get(table, "probe", path))}
    for row in _get(table, "rows", path):
        for k in PREDICTION_KEYS:
            facts[f"{_get(row, 'id', path)}.{k}"] = row.get(k)
    return facts


def _selection_facts(path: Path) -> dict[str, Any]:
    selected = _get(_read_json(path), "selected", path)
    return {"selected": _get(selected, "id", path)}


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


def _probe_outcomes(run: Path) -> dict[str, Any]:
    return {f"{p.stem} status": _get(_read_json(p), "status", p) for p in sorted((run / "probes").glob("*.json"))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="memfit compare-results",
        description="Compare two results/ trees: selections, per-step losses, resume verdicts. Exit 1 on a difference.",
    )
    ap.add_argument("first", type=Path, help="results directory (e.g. of the baseline)")
    ap.add_argument("second", type=Path, help="results directory to compare with it")
    ap.add_argument("--rtol", type=float, default=0.0, help="relative tolerance for floats (default 0: identical)")
    args = ap.parse_args(argv)
    diffs = compare_trees(args.first, args.second, args.rtol)
    for line in diffs:
        print(line)
    n = len(run_dirs(args.first) & run_dirs(args.second))
    verdict = f"{len(diffs)} difference(s)" if diffs else "the same"
    print(f"{args.first} vs {args.second}: {n} run(s) compared, {verdict}", file=sys.stderr)
    return 1 if diffs else 0
