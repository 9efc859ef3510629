"""A cluster config with several models and GPU types, planned only: the report's contents, one
folding section per model x GPU x method, and the GPU type x model x method fit map.

The runs are made by the workflow's own stages (memfit.workflow.pipeline.estimate_candidates and
select_config, as `snakemake --configfile config/cluster-example.yaml --config plan_only=True`
runs them), from config/cluster-example.yaml with the search space narrowed and analytic
activations so the plan takes seconds.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
from test_report import _text

from memfit import exports, report
from memfit.estimate.models import catalog
from memfit.estimate.search import fit
from memfit.report.fitmap import SETTINGS
from memfit.space import Candidate
from memfit.workflow import pipeline
from memfit.workflow.config import WorkflowConfig, load_yaml

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["qwen2.5-7b", "llama-3.1-8b"]
GPUS = ["a100-80gb", "h100-80gb"]
METHODS = ["sft", "dpo"]


def _plan(root: Path, models=MODELS, gpus=GPUS, methods=METHODS, plan_only=True) -> list[Path]:
    raw = copy.deepcopy(load_yaml(ROOT / "config" / "cluster-example.yaml"))
    raw["models"] = {m: raw["models"][m] for m in models}
    raw |= {
        "gpus": gpus,
        "methods": methods,
        "plan_only": plan_only,
        "estimate": {"activations": "analytic"},
        "host_memory_gib": HOST_GIB,
    }
    raw["search"] |= {
        "offload_param": ["none"],
        "pin_memory": [False],
        "attn": ["flash"],
        "micro_batch": [1, 2],
    }
    cfg = WorkflowConfig.load(raw)
    selected = []
    for model in models:
        for gpu in gpus:
            for method in methods:
                run = root / "results" / model / gpu / method
                run.mkdir(parents=True)
                pipeline.estimate_candidates(cfg, model, gpu, method, run / "candidates.json")
                out = {k: run / f for k, f in (("selected", "selected.json"), ("run", "run.json"),
                                                ("ds_config", "ds_config.json"), ("launch", "launch.sh"))}  # fmt: skip
                out |= {k: p for k, p in exports.paths(run, method).items()}  # as plan.smk declares them
                pipeline.select_config(cfg, model, gpu, method, run / "candidates.json", [], cfg.model_path(model),
                                       f"results/{model}/data/{method}", f"{run}/train", out)  # fmt: skip
                selected.append(out["selected"])
    return selected


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> tuple[Path, list[Path], str]:
    root = tmp_path_factory.mktemp("cluster")
    selected = _plan(root)
    out = root / "results" / "report.html"
    report.write_report(selected, [], [], [], out)  # a plan-only run has no training outputs
    return root, selected, out.read_text()


def test_contents_group_every_combination_by_model(planned):
    _, selected, page = planned
    nav = re.search(r'<nav class="toc">(.*?)</nav>', page, re.S).group(1)
    for model in MODELS:
        line = re.search(rf'<span class="model">{re.escape(model)}</span>:(.*?)</li>', nav).group(1)
        assert re.findall(r">([^<]+)</a>", line) == [f"{g} · {m}" for g in GPUS for m in METHODS]
    assert len(re.findall(r'href="#run-\d+"', nav)) == len(selected) == 8
    assert '<a href="#fitmap">' in nav and '<a href="#data">' in nav
    # each combination folds, and its section is where the contents link points
    assert page.count('<details open class="run">') == 8
    for i in range(8):
        assert f'<h2 id="run-{i}">' in page


def test_plan_only_shows_the_plan_and_no_training(planned):
    _, selected, page = planned
    text = _text(page)
    assert text.count("Plan only: no probe ran and nothing was trained") == 8
    for word in ("Did training work", "Resume check", "training curves", "resume check"):
        assert word not in text, f"a plan-only page says {word!r}"
    for p in selected:
        sel = json.loads(p.read_text())
        assert sel["plan_only"] is True and sel["selected"]["id"] in text and sel["launch"] in text
    assert page.count('alt="memory per candidate') == 8 and page.count('alt="predicted memory breakdown') == 8


def _grid(page: str) -> tuple[list[str], dict[str, list[tuple[str, str]]]]:
    """The fit grid's column headers and, per GPU type, each cell's (text, class): the rows in view
    and the ones folded below them (a second table of the same columns)."""
    tables = re.findall(r"<table class='grid'>(.*?)</table>", page, re.S)
    assert 1 <= len(tables) <= 2, "the fit map is drawn once (its folded rows apart)"
    cells, heads = {}, []
    for table in tables:
        rows = re.findall(r"<tr>(.*?)</tr>", table, re.S)
        heads = re.findall(r"<th[^>]*>(.*?)</th>", rows[1])
        for r in rows[2:]:
            name = re.match(r"<td>([^<]+)</td>", r).group(1)
            cells[name] = re.findall(r"<td class='n ([^']*)'[^>]*>([^<]*)</td>", r)
    return heads, {k: [(t, c) for c, t in v] for k, v in cells.items()}


def test_fit_grid_is_gpu_type_by_model_by_method_with_memfit_fit_values(planned):
    root, selected, page = planned
    heads, cells = _grid(page)
    assert set(cells) == set(catalog.load_gpus())  # every GPU type of the catalog, down
    # across: one column per model x method x selected configuration, grouped by model
    sels = [json.loads(p.read_text()) for p in selected]
    setups = list(dict.fromkeys((s["model"], s["method"], s["selected"]["id"]) for s in sels))
    assert len(heads) == len(setups) >= len(MODELS) * len(METHODS)
    legend = re.search(r"<ul class='legend'>(.*?)</ul>", page, re.S).group(1)
    world = json.loads((selected[0].parent / "candidates.json").read_text())["world_size"]
    ordered = [s for m in MODELS for s in setups if s[0] == m]
    for col, (model, method, cid) in enumerate(ordered):
        assert heads[col].startswith(method)
        assert f"{model} · {method}: <code>{cid}</code>, selected for" in legend
        cand = Candidate.from_dict(next(s["selected"]["candidate"] for s in sels if s["selected"]["id"] == cid))
        arch = catalog.model(model)
        for name, gpu in catalog.load_gpus().items():
            # the value is what `memfit fit --maximize seq_len` gives for that setup on that GPU type
            longest, _ = fit(arch, gpu, world, 1, method, cand, "seq_len", settings=SETTINGS)
            text, cls = cells[name][col]
            assert text.replace(",", "").removesuffix(" (max)") == (str(longest) if longest else "—")
            want = "ok" if longest >= cand.seq_len else "short" if longest else "bad"
            assert cls.split()[0] == want, (name, model, method, text, cls)
            # the GPU types the setup was selected for are outlined
            picked = {
                s["gpu"] for s in sels if s["selected"]["id"] == cid and s["model"] == model and s["method"] == method
            }
            assert ("here" in cls.split()) == (name in picked)
    # an 80 GB GPU trains a 7-8B model at the selected length; a 16 GB V100 cannot at that length
    assert all(cls.startswith("ok") for _, cls in cells["h100-80gb"])
    assert not any(cls.startswith("ok") for _, cls in cells["v100-16gb"])


def _hrefs(page: str) -> list[str]:
    """The links of every run's launch-files table."""
    tables = re.findall(r"<table class='exports'>(.*?)</table>", page, re.S)
    return [h for t in tables for h in re.findall(r'<a href="([^"]+)">', t)]


def test_each_run_links_its_launch_files_and_exports_relative_to_the_page(planned):
    root, selected, page = planned
    out_dir = root / "results"  # report.html's folder
    linked = {(out_dir / h).resolve() for h in _hrefs(page)}
    assert all(not h.startswith(("/", "file:")) for h in _hrefs(page))  # relative: the results folder can move
    for p in selected:
        run, sel = p.parent, json.loads(p.read_text())
        want = {run / "launch.sh", run / "run.json", run / "ds_config.json"}
        want |= set(exports.paths(run, sel["method"]).values())
        assert {w.resolve() for w in want} <= linked, sorted(map(str, want - linked))
        assert all(w.is_file() for w in want)
        assert sel["launch"] in _text(page)  # the exact launch command, beside the files
    text = _text(page)
    for what in ("OpenRLHF command", "LLaMA-Factory config", "HF TrainingArguments"):
        assert text.count(what) == 2 * len(selected), what  # in each run's table and above its folded text


# ------------------------------------------------------------------ a plan where nothing fits
BIG = "qwen2.5-72b"  # full fine-tune of 72B on one node of 8 x 80 GB: the optimizer offload needs more host RAM than the node has
# the node's RAM in these plans: 72B's offloaded optimizer needs 1,243 GiB on one node, 701 GiB on two
HOST_GIB = 1024


@pytest.fixture(scope="module")
def none_fits(tmp_path_factory) -> tuple[Path, list[Path], str]:
    root = tmp_path_factory.mktemp("nonefits")
    selected = _plan(root, models=[BIG, "qwen2.5-7b"], gpus=["h100-80gb"], methods=["sft"])
    out = root / "results" / "report.html"
    report.write_report(selected, [], [], [], out)
    return root, selected, out.read_text()


def test_plan_only_where_nothing_fits_writes_that_answer_and_nothing_launchable(none_fits):
    import subprocess

    import yaml

    root, selected, _ = none_fits
    run = selected[0].parent
    sel = json.loads(selected[0].read_text())
    reason = sel["none_fits"]
    assert sel["selected"] is None and sel["launch"] is None and sel["plan_only"] is True
    assert reason.startswith("no candidate fits the budget") and "host RAM" in reason
    table = json.loads((run / "candidates.json").read_text())
    assert len(sel["candidates"]) == len(table["rows"]) > 1
    assert all(not c["fits"] and c["reason"] for c in sel["candidates"])  # every one says why it lost
    # the closest candidate comes first and is the one the reason names
    assert f"the closest, {sel['candidates'][0]['id']}:" in reason
    # nothing beside it pretends to be a run: memfit's files hold the reason only, launch.sh fails with it
    note = {"none_fits": reason}
    assert json.loads((run / "run.json").read_text()) == note
    assert json.loads((run / "ds_config.json").read_text()) == note
    done = subprocess.run(["bash", str(run / "launch.sh")], capture_output=True, text=True)
    assert done.returncode == 1 and reason in done.stderr and done.stdout == ""
    # the exports: NONE_FITS.txt says why; each path the workflow declares holds the reason only
    assert reason in (run / exports.NONE_FITS).read_text()
    for key, p in exports.paths(run, "sft").items():
        if p.suffix == ".json":
            assert json.loads(p.read_text()) == note, key
        elif p.suffix == ".yaml":
            assert yaml.safe_load(p.read_text()) == note, key
        else:
            r = subprocess.run(["bash", str(p)], capture_output=True, text=True)
            assert r.returncode == 1 and reason in r.stderr, key
    assert {p.name for p in (run / "exports").rglob("*") if p.is_file()} == {
        "NONE_FITS.txt",
        *(Path(f.format(method="sft")).name for f in exports.FILES.values()),
    }


def test_the_nodes_hint_is_what_a_plan_on_that_many_nodes_selects(none_fits, tmp_path):
    """'would fit on N nodes (estimate ...)': planning the same search space on N nodes selects
    the candidate the hint names, and on N - 1 nodes nothing fits."""
    root, selected, _ = none_fits
    reason = json.loads(selected[0].read_text())["none_fits"]
    m = re.search(
        r"would fit on (\d+) nodes \(estimate; 8 h100-80gb per node, fastest there: ([\w-]+)\)",
        reason,
    )
    assert m, reason
    nodes, cand = int(m.group(1)), m.group(2)
    raw = copy.deepcopy(load_yaml(ROOT / "config" / "cluster-example.yaml"))
    raw |= {"plan_only": True, "num_nodes": nodes, "estimate": {"activations": "analytic"}, "host_memory_gib": HOST_GIB}
    raw["search"] |= {
        "offload_param": ["none"],
        "pin_memory": [False],
        "attn": ["flash"],
        "micro_batch": [1, 2],
    }
    run = tmp_path / "results" / BIG / "h100-80gb" / "sft"
    run.mkdir(parents=True)
    out = {k: run / f for k, f in (("selected", "selected.json"), ("run", "run.json"),
                                    ("ds_config", "ds_config.json"), ("launch", "launch.sh"))}  # fmt: skip
    pipeline.estimate_candidates(raw, BIG, "h100-80gb", "sft", run / "candidates.json")
    sel = pipeline.select_config(raw, BIG, "h100-80gb", "sft", run / "candidates.json", [], None, "d", "t", out)
    assert sel["selected"]["id"] == cand
    assert not (run / exports.NONE_FITS).exists()  # a plan that fits writes the exports, no NONE_FITS.txt
    assert nodes == 2  # one node is what failed; the hint looks from num_nodes + 1 up


def test_a_training_run_where_nothing_fits_still_stops_with_every_reason(none_fits, tmp_path):
    from memfit.estimate.selection import NoneFits

    root, selected, _ = none_fits
    raw = copy.deepcopy(load_yaml(ROOT / "config" / "cluster-example.yaml")) | {"plan_only": False}
    raw["estimate"] = {"activations": "analytic"}
    out = {k: tmp_path / f for k, f in (("selected", "selected.json"), ("run", "run.json"),
                                         ("ds_config", "ds_config.json"), ("launch", "launch.sh"))}  # fmt: skip
    with pytest.raises(
        NoneFits,
        match=r"(?s)no candidate fits the budget.*would fit on 2 nodes.*Every candidate lost:\n  z3-",
    ):
        pipeline.select_config(raw, BIG, "h100-80gb", "sft", selected[0].parent / "candidates.json", [], "/models/x",
                               "d", "t", out)  # fmt: skip
    assert not any(tmp_path.iterdir())  # nothing written: the workflow stops at select_config


def test_report_shows_a_run_where_nothing_fits_as_does_not_fit_with_the_reason(none_fits):
    root, selected, page = none_fits
    text = _text(page)
    reason = json.loads(selected[0].read_text())["none_fits"]
    ok = json.loads(selected[1].read_text())
    # overview: the run that fits shows its candidate, the other "does not fit" with why
    overview = re.search(r'<h2 id="runs">(.*?)</table>', page, re.S).group(1)
    assert ok["selected"]["id"] in overview and f"does not fit: {_text(reason)}" in _text(overview)
    # its section: the banner with the reason, no launch command, every candidate in the table
    section = re.search(r'<h2 id="run-0">(.*?)<h2 id="run-1">', page, re.S).group(1)
    assert f"Does not fit: {_text(reason)}" in _text(section)
    assert "Launch command" not in _text(section) and ok["launch"] in text
    for c in json.loads(selected[0].read_text())["candidates"]:
        assert f"<code>{c['id']}</code>" in section
    # its files: NONE_FITS.txt first, linked
    hrefs = _hrefs(section)
    assert hrefs[0] == f"{BIG}/h100-80gb/sft/exports/NONE_FITS.txt"
    # the fit map draws the closest candidate, said as such, beside the selected one of the 7B run
    heads, cells = _grid(page)
    assert heads == ["sft (none fits) <sup>1</sup>", "sft <sup>2</sup>"]
    legend = re.search(r"<ul class='legend'>(.*?)</ul>", page, re.S).group(1)
    closest = json.loads(selected[0].read_text())["candidates"][0]["id"]
    assert f"{BIG} · sft: <code>{closest}</code>, nothing fits; the closest candidate for h100-80gb" in legend
    assert "No fit map" not in text
