"""The report as a reader's browser shows it: headless Chromium opens the page from disk, networking off.

Asserts no console errors, every image decoded, nothing fetched from outside the file, no
horizontal overflow at 1280 px, that every part of the page (each template under
memfit/report/templates) renders in a reader's order with its figures visible, and that the
numbers a reader acts on (the selected candidate, its device peak and throughput, the launch
command, the resume verdict, the final losses, the data counts) are on the page as they are in
selected.json, verify_resume.json, train/summary.json, train/metrics.jsonl and stats.json.

By default the page is rendered from synthetic inputs (a trained DPO run and plan-only runs for
several models x GPU types); set MEMFIT_REPORT_HTML=results/report.html to check a real run's page instead (.ci/run
does this after the demo). Skipped, with the reason, where no Chromium binary exists.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
from test_report import _dpo_run
from test_report_curves import _with_fallback

from memfit import report
from memfit.estimate.models import catalog
from memfit.report.browser import find_chromium, inspect_page
from memfit.report.fmt import _bytes, _plain, _secs, _tps, describe

pytestmark = pytest.mark.skipif(
    find_chromium() is None,
    reason="no Chromium binary (apt-get install -y chromium, or set MEMFIT_CHROMIUM)",
)

WIDTH = 1280


PLANNED = [("demo-tiny", "h100-80gb"), ("qwen2.5-7b", "h100-80gb"), ("qwen2.5-7b", "a100-40gb")]


def _synthetic(tmp_path: Path) -> Path:
    """A cluster-like page: one trained DPO run (resumed after a crash, one OOM fallback, its
    resume check failed) and plan-only runs for several models x GPU types (the plan-only fixture
    relabelled)."""
    trained = _with_fallback(tmp_path)
    plan = _dpo_run(tmp_path / "plan", plan_only=True)["selected"].parent
    selected = [trained["selected"]]
    for model, gpu in PLANNED:
        run = tmp_path / "results" / model / gpu / "dpo"
        run.mkdir(parents=True)
        for f in plan.iterdir():
            obj = json.loads(f.read_text())
            if f.name == "selected.json":
                obj.update(
                    model=model,
                    gpu=gpu,
                    launch=obj["launch"].replace("demo-tiny/cpu", f"{model}/{gpu}"),
                )
            (run / f.name).write_text(json.dumps(obj))
        selected.append(run / "selected.json")
    out = tmp_path / "results" / "report.html"
    report.write_report(
        selected=[str(p) for p in selected],
        summaries=[str(trained["summary"])],
        resume=[str(trained["resume"])],
        data_stats=[str(trained["data"])],
        out_html=str(out),
    )
    return out


def _demo_like(tmp_path: Path) -> Path:
    """The demo's page from fixtures: a trained DPO run (a crash, an OOM fallback, a failed resume
    check) and a trained SFT run beside it, each with 40 candidates as a search space gives."""
    trained = _with_fallback(tmp_path)
    dpo = trained["selected"].parent
    sel = json.loads(trained["selected"].read_text())
    base = sel["candidates"][-1]
    for i in range(40 - len(sel["candidates"])):
        sel["candidates"].append(base | {"id": f"z3-gc-sdpa-full-mb{i + 1}-s32-fp32-ref-model-loss-chunked",
                                         "source": "predicted", "fits": True, "probe": None,
                                         "reason": "not probed: predicted to fit, ranked below the probed candidates"})  # fmt: skip
    trained["selected"].write_text(json.dumps(sel))
    sft = dpo.parent / "sft"
    shutil.copytree(dpo, sft)
    sel.update(method="sft", launch=sel["launch"].replace("/dpo/", "/sft/"))
    (sft / "selected.json").write_text(json.dumps(sel))
    stats = json.loads(trained["data"].read_text()) | {"method": "sft"}
    (trained["data"].parent.parent / "sft").mkdir()
    (trained["data"].parent.parent / "sft" / "stats.json").write_text(json.dumps(stats))
    out = tmp_path / "results" / "report.html"
    report.write_report(
        selected=[str(dpo / "selected.json"), str(sft / "selected.json")],
        summaries=[str(d / "train" / "summary.json") for d in (dpo, sft)],
        resume=[str(d / "verify_resume.json") for d in (dpo, sft)],
        data_stats=[str(trained["data"]), str(trained["data"].parent.parent / "sft" / "stats.json")],
        out_html=str(out),
    )
    return out


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    given = os.environ.get("MEMFIT_REPORT_HTML")
    if given:
        path = Path(given).resolve()
        assert path.is_file(), f"MEMFIT_REPORT_HTML={given}: no such file"
        return path
    return _synthetic(tmp_path_factory.mktemp("browser"))


@pytest.fixture(scope="module")
def seen(page):
    t0 = time.perf_counter()
    check = inspect_page(page, width=WIDTH)
    print(f"Chromium opened {page} in {time.perf_counter() - t0:.1f} s")
    return check


def _runs(page: Path) -> list[Path]:
    # the page's own runs: <model>/<gpu>/<method>/ beside it (not another `run: NAME`'s, results/NAME/...)
    runs = sorted(p.parent for p in page.parent.glob("*/*/*/selected.json"))
    assert runs, f"no selected.json under {page.parent}"
    return runs


def _section(text: str, run: Path) -> str:
    """The run's part of the page text: from its 'From …/selected.json.' line to the next run's."""
    tail = "/".join(run.parts[-3:]) + "/selected.json"
    starts = [m.start() for m in re.finditer(r"From \S*selected\.json\.", text)]
    mine = [s for s in starts if text[s:].split(None, 2)[1].rstrip(".").endswith(tail)]
    assert len(mine) == 1, f"the page has {len(mine)} sections for {tail}"
    later = [s for s in starts if s > mine[0]]
    return text[mine[0] : later[0] if later else len(text)]


def _html(page: Path) -> str:
    """The page's source with entities decoded: what a reader reaches by opening the folded parts."""
    return html.unescape(page.read_text())


def test_no_console_errors_and_nothing_fetched(seen):
    assert seen.errors == []
    assert seen.resources == [], "the page must render from the file alone"


def test_every_image_decoded(seen):
    assert seen.images, "the page has no figures"
    bad = [im for im in seen.images if not im["complete"] or im["naturalWidth"] <= 0]
    assert bad == []


def test_no_horizontal_overflow_at_laptop_width(seen):
    assert seen.inner_width == WIDTH
    assert seen.scroll_width <= WIDTH, f"page is {seen.scroll_width} px wide at a {WIDTH} px window"


def test_selection_numbers_match_selected_json(page, seen):
    for run in _runs(page):
        sel = json.loads((run / "selected.json").read_text())
        text = _section(seen.text, run)
        chosen = sel["selected"]
        if chosen is None:  # a plan where nothing fits: the answer and why, no launch command
            assert f"Does not fit: {sel['none_fits']}" in text and "Launch command" not in text
            assert "exports/NONE_FITS.txt" in text
            continue
        assert chosen["id"] in text
        if sel.get("launch"):
            assert sel["launch"] in text
        if chosen.get("device_bytes") is not None:
            assert f"device peak {_bytes(chosen['device_bytes'])}" in text
        if chosen.get("tokens_per_s") is not None:
            assert _tps(chosen["tokens_per_s"]) in text
        if sel.get("plan_only"):  # the plan, and no training sections
            assert "Plan only" in text and "Did training work" not in text and "Resume check" not in text


def test_resume_and_training_numbers_match_their_files(page, seen):
    checked = 0
    for run in _runs(page):
        text = _section(seen.text, run)
        resume = run / "verify_resume.json"
        if resume.is_file():
            check = json.loads(resume.read_text())
            verdict = "passed" if check["passed"] else "FAILED"
            assert f"Resume check figures: result {verdict}" in text, f"{run}: resume verdict {verdict} not shown"
            if not check["passed"]:
                assert "Resume check did NOT pass" in text
            folded = _html(page)  # the figures fold under the verdict: in the page, one click away
            assert check["resumed_from"] in folded
            assert f"{_plain(check['max_rel_loss_diff'])} (tolerance {_plain(check['rtol'])})" in folded
            checked += 1
        summary = run / "train" / "summary.json"
        if summary.is_file():
            s = json.loads(summary.read_text())
            assert "Did training work?" in text
            assert f"steps\t{_plain(s['steps'])}" in text
            for n, f in enumerate(s.get("fallbacks") or [], 1):  # each OOM fallback listed, and marked (folded)
                assert f"OOM {n} at step {f['oom_step']}" in _html(page)
                assert f"resumed from the checkpoint at step {f['resumed_from_step']} on {f['to']}" in _html(page)
                assert f["to"] in text
            assert f"peak allocated per device\t{_bytes(s['peak_allocated_bytes'])}" in text
            rows = [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines() if line]
            for split in ("train", "eval"):
                last = [r for r in rows if r.get("split", "train") == split and r.get("loss") is not None]
                if last:
                    assert f"final {split} loss (step {last[-1]['step']})\t{_plain(last[-1]['loss'])}" in text
            checked += 1
    if not os.environ.get("MEMFIT_REPORT_HTML"):
        assert checked == 2, "the synthetic page has one trained run with a resume check"


def test_every_combination_is_in_the_contents_and_folds(page, seen):
    runs = _runs(page)
    html = page.read_text()
    nav = re.search(r'<nav class="toc">(.*?)</nav>', html, flags=re.S)
    assert nav is not None, "no table of contents"
    assert len(re.findall(r'href="#run-\d+"', nav.group(1))) == len(runs)
    if len(runs) > 1:
        assert html.count('<details open class="run">') == len(runs)
    assert "Run facts" in seen.text


# The page's parts (templates/*.html.j2) as a reader sees their headings, in order.
PAGE_PARTS = (
    "memfit report",
    "Generated",
    "Runs: the answer",
    "Contents",
    "What hardware fits: GPU type × model × method",
    "Data",
)
RUN_PARTS = (  # selected.html.j2, selection.html.j2, the charts (folded), a link to the one fit map
    "Selected configuration",
    "Selection: every candidate",
    "Will it fit? Memory per candidate",
)
TRAINED_PARTS = ("Did training work?", "Resume check")  # training.html.j2, resume.html.j2


def _in_order(text: str, parts) -> None:
    at = 0
    for part in parts:
        found = text.find(part, at)
        assert found >= 0, f"{part!r} missing (or out of order) after {text[max(0, at - 80) : at]!r}"
        at = found + len(part)


def _shown(seen) -> set[str]:
    """The alt text of every figure that decoded and takes room on the page."""
    return {im["alt"] for im in seen.images if im["naturalWidth"] > 0 and im["width"] > 0}


def test_every_part_of_the_page_renders_in_order(page, seen):
    _in_order(seen.text, PAGE_PARTS)
    head = seen.text[: seen.text.find("What hardware fits: GPU type")]
    for run in _runs(page):  # the Runs table lists every run
        sel = json.loads((run / "selected.json").read_text())
        assert " · ".join(sel[k] for k in ("model", "gpu", "method")) in head
    facts = seen.text[seen.text.rfind("Run facts") :]
    assert "git commit " in facts and "packages" in facts


def test_every_run_section_renders_each_part(page, seen):
    gpus = list(catalog.load_gpus())
    for run in _runs(page):
        sel = json.loads((run / "selected.json").read_text())
        text = _section(seen.text, run)
        trained = not sel.get("plan_only") and (run / "train" / "summary.json").is_file()
        _in_order(text, RUN_PARTS + (TRAINED_PARTS if trained else ()))
        title = " · ".join(sel[k] for k in ("model", "gpu", "method"))
        assert "What hardware fits: the fit map above" in text or f"No fit map for {title}" in text
        figures, source = _shown(seen), _html(page)
        assert f'alt="memory per candidate, {title}"' in source  # folded: one click away
        if (run / "candidates.json").is_file():
            assert f'alt="predicted memory breakdown per candidate, {title}"' in source
        if trained and (run / "train" / "metrics.jsonl").is_file():  # the curves stay in view
            assert any(a.startswith(f"training curves, {title}") for a in figures)
        # the selection table: the top ten in view, the others counted and folded below them
        ids = [c["id"] for c in sel["candidates"]]
        missing = [i for i in ids if not re.search(rf"(?<![\w-]){re.escape(i)}(?![\w-])", text)]
        assert len(missing) == max(0, len(ids) - 10)
        if missing:
            assert f"{len(missing)} more candidates, ranked below the top 10" in text
    # the fit map, once: a row per catalog GPU type (ten in view, the rest folded), or why there is none
    assert seen.text.count("What hardware fits: GPU type × model × method") == 1
    fitmap = _html(page)[_html(page).find('id="fitmap"') :]
    assert "No fit map for" in fitmap or all(f"<tr><td>{g}</td>" in fitmap for g in gpus)


def test_data_section_shows_each_stats_file(page, seen):
    data = seen.text[seen.text.rfind("\nData\n") :]
    stats = sorted(page.parent.glob("*/data/*/stats.json"))
    if not stats:
        assert "no length statistics" in data or "No data statistics" in data
    for p in stats:
        s = json.loads(p.read_text())
        title = f"{p.parent.parent.parent.name} · {s.get('method') or p.parent.name}"
        _in_order(data, [title, f"rows read\t{_plain(s['rows_read'])}"])
        if s.get("length"):
            assert f"length distribution, {title}" in _shown(seen)


SCREEN = 800  # a laptop's first screen: 1280 x 800 CSS px


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, object]:
    """The demo's page (MEMFIT_REPORT_HTML, else built from fixtures) as Chromium shows its first 1280 x 800."""
    given = os.environ.get("MEMFIT_REPORT_HTML")
    page = Path(given).resolve() if given else _demo_like(tmp_path_factory.mktemp("demo"))
    return page, inspect_page(page, width=WIDTH, height=SCREEN)


def test_first_screen_holds_the_answer(demo):
    """Without scrolling: per run the configuration in words, the margin to the budget, the final
    train and eval loss, the resume verdict, predicted vs measured peak and step time (#43)."""
    page, seen = demo
    first = seen.first_screen
    for run in _runs(page):
        sel = json.loads((run / "selected.json").read_text())
        title = " · ".join(sel[k] for k in ("model", "gpu", "method"))
        assert title in first, f"{title} is not on the first {SCREEN} px"
        if sel["selected"] is None:
            assert f"does not fit: {sel['none_fits']}" in first
            continue
        chosen = sel["selected"]
        assert chosen["id"] in first
        assert describe(chosen["candidate"], sel["method"], 2).split(", ")[0] in first  # the words begin there
        assert "below the usable" in first or "OVER the usable" in first  # the margin to the budget
        assert f"predicted {_bytes(chosen['predicted']['peak_allocated_bytes'])}" in first
        summary = run / "train" / "summary.json"
        if summary.is_file():
            s = json.loads(summary.read_text())
            assert f"training {_bytes(s['peak_allocated_bytes'])}" in first
            assert f"training {_secs(s['step_time_s'])}" in first
            rows = [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines() if line]
            for split in ("train", "eval"):
                last = [r for r in rows if r.get("split", "train") == split and r.get("loss") is not None]
                if last:
                    assert f"{split} {_plain(last[-1]['loss'])} (step {last[-1]['step']})" in first
        resume = run / "verify_resume.json"
        if resume.is_file():
            verdict = "passed" if json.loads(resume.read_text())["passed"] else "FAILED"
            assert re.search(rf"\(step \d+\) {verdict}\b", first), f"{title}: resume verdict {verdict} not in view"
    # one definition per throughput figure, said where the figures are
    assert "probe tok/s: padded worst-case batch, all ranks" in first
    assert "training tok/s: real tokens, rank 0" in first


def test_demo_page_is_at_most_8000_px_high(demo):
    page, seen = demo
    assert seen.scroll_height <= 8000, f"{page} is {seen.scroll_height} px high at {WIDTH} px (at most 8,000)"
    assert seen.text.count("What hardware fits: GPU type × model × method") == 1  # the fit map once


def test_long_tables_show_their_top_ten(demo):
    page, seen = demo
    for run in _runs(page):
        sel = json.loads((run / "selected.json").read_text())
        text = _section(seen.text, run)
        ids = [c["id"] for c in sel["candidates"]]
        shown = [i for i in ids if re.search(rf"(?<![\w-]){re.escape(i)}(?![\w-])", text)]
        assert len(shown) == min(10, len(ids)), f"{run}: {len(shown)} candidates in view"
        if len(ids) > 10:
            assert f"{len(ids) - 10} more candidates, ranked below the top 10" in text
            assert all(i in _html(page) for i in ids)  # the others folded, not dropped
