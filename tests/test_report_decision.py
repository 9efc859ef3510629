"""The report says why the selected candidate won: fastest, tied and settled by the tie rule, or alone.

selected.json is written here the way the workflow's select step writes it (memfit.estimate.selection's
judge and choose, then Selection.to_json), so the page reads the `decision` selection records.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

from memfit import report
from memfit.estimate.rows import Budget, Selection
from memfit.estimate.selection import choose, judge

MiB = 2**20
BUDGET = Budget(device_bytes=100 * MiB, host_bytes=1024 * MiB, headroom=0.1)


def _est(cid: str, zero: int = 2, grad_ckpt: bool = False) -> dict:
    cand = {"zero": zero, "grad_ckpt": grad_ckpt, "micro_batch": 2, "grad_accum": 4, "seq_len": 32}
    return {
        "id": cid, "candidate": cand, "peak_allocated_bytes": 50 * MiB, "peak_reserved_bytes": 50 * MiB,
        "device_total_bytes": 50 * MiB, "host_bytes": 100 * MiB, "step_time_s": 1.0, "fits": True,
    }  # fmt: skip


def _probe(cid: str, alloc_mib: int, step_s: float) -> dict:
    return {
        "id": cid, "status": "ok", "device": "cpu", "peak_allocated_bytes": alloc_mib * MiB,
        "peak_reserved_bytes": None, "host_rss_bytes_node": 500 * MiB, "step_time_s": step_s,
    }  # fmt: skip


def _page(tmp_path: Path, estimates: list[dict], probes: dict[str, dict]) -> str:
    """Select as the workflow does, write selected.json, render the report; its visible text."""
    best, ranked = choose(judge(estimates, probes, BUDGET, world=2, method="sft"))
    sel = Selection("demo-tiny", "cpu", "sft", best, BUDGET, False, "memfit launch --nproc 2", ranked)
    path = tmp_path / "results" / "demo-tiny" / "cpu" / "sft" / "selected.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(sel.to_json()))
    out = report.write_report([str(path)], [], [], [], tmp_path / "results" / "report.html")
    text = html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", out.read_text())))
    return re.sub(r" ([.:,;])", r"\1", text)  # "<strong>fastest</strong>:" reads "fastest:"


def test_a_clear_winner_is_chosen_because_it_is_fastest_by_a_margin_beyond_the_noise(tmp_path):
    text = _page(
        tmp_path,
        [_est("fast"), _est("slow", zero=3)],
        {"fast": _probe("fast", 60, 0.5), "slow": _probe("slow", 40, 1.0)},
    )
    assert (
        "Chosen because: fastest: 100% more throughput than the runner-up, slow, "
        "more than the measured noise (20%)." in text
    )


def test_a_tie_within_the_noise_is_settled_by_less_device_memory(tmp_path):
    # "lean" is 10% slower than "quick", inside the CPU's 20% noise: the smaller peak wins
    text = _page(
        tmp_path,
        [_est("quick"), _est("lean", zero=3)],
        {"quick": _probe("quick", 80, 1.0), "lean": _probe("lean", 40, 1.1)},
    )
    assert "Chosen because: tied on speed, so less device memory" in text
    assert "tied with 1 other candidate within the measured noise (20%): the runner-up, quick, is 9% faster" in text
    assert "its device peak is 40.0 MiB against 80.0 MiB" in text


def test_a_tie_at_equal_memory_is_settled_by_fewer_levers(tmp_path):
    text = _page(
        tmp_path,
        [_est("ckpt", grad_ckpt=True), _est("plain")],
        {"ckpt": _probe("ckpt", 50, 1.0), "plain": _probe("plain", 50, 1.05)},
    )
    assert "Chosen because: tied on speed, so fewer memory levers at the same device memory" in text


def test_the_only_fitting_candidate_says_so(tmp_path):
    text = _page(
        tmp_path,
        [_est("small"), _est("big", zero=0)],
        {"small": _probe("small", 50, 1.0), "big": _probe("big", 95, 0.5)},  # 95 MiB > 90 MiB usable
    )
    assert "Chosen because: the only candidate that fits." in text


def test_a_selection_without_a_recorded_decision_shows_no_reason(tmp_path):
    """selected.json files written before selection recorded its decision still render."""
    page = _page(tmp_path, [_est("a")], {"a": _probe("a", 50, 1.0)})
    path = tmp_path / "results" / "demo-tiny" / "cpu" / "sft" / "selected.json"
    doc = json.loads(path.read_text())
    del doc["selected"]["decision"]
    path.write_text(json.dumps(doc))
    out = report.write_report([str(path)], [], [], [], tmp_path / "results" / "report.html")
    assert "Chosen because" in page and "Chosen because" not in out.read_text()
