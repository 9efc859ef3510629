"""A cluster config with several models and GPU types, planned only: the report's contents, one
folding section per model x GPU x method, and the GPU type x model x method fit map.

The runs are made by the workflow's own stages (memfit.pipeline.estimate_candidates and
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

from memfit import catalog, pipeline, report
from memfit.config import WorkflowConfig, load_yaml
from memfit.estimate.core import fit
from memfit.report.fitmap import SETTINGS
from memfit.space import Candidate

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["qwen2.5-7b", "llama-3.1-8b"]
GPUS = ["a100-80gb", "h100-80gb"]
METHODS = ["sft", "dpo"]


def _plan(root: Path) -> list[Path]:
    raw = copy.deepcopy(load_yaml(ROOT / "config" / "cluster-example.yaml"))
    raw["models"] = {m: raw["models"][m] for m in MODELS}
    raw |= {
        "gpus": GPUS,
        "methods": METHODS,
        "plan_only": True,
        "estimate": {"activations": "analytic"},
    }
    raw["search"] |= {
        "offload_param": ["none"],
        "pin_memory": [False],
        "attn": ["flash"],
        "micro_batch": [1, 2],
    }
    cfg = WorkflowConfig.load(raw)
    selected = []
    for model in MODELS:
        for gpu in GPUS:
            for method in METHODS:
                run = root / "results" / model / gpu / method
                run.mkdir(parents=True)
                pipeline.estimate_candidates(cfg, model, gpu, method, run / "candidates.json")
                out = {k: run / f for k, f in (("selected", "selected.json"), ("run", "run.json"),
                                                ("ds_config", "ds_config.json"), ("launch", "launch.sh"))}  # fmt: skip
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
    assert (
        page.count('alt="memory per candidate') == 8
        and page.count('alt="predicted memory breakdown') == 8
    )


def _grid(page: str) -> tuple[list[str], dict[str, list[tuple[str, str]]]]:
    """The fit grid's column headers and, per GPU type, each cell's (text, class)."""
    table = re.search(r"<table class='grid'>(.*?)</table>", page, re.S).group(1)
    rows = re.findall(r"<tr>(.*?)</tr>", table, re.S)
    heads = re.findall(r"<th[^>]*>(.*?)</th>", rows[1])
    cells = {}
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
        cand = Candidate.from_dict(
            next(s["selected"]["candidate"] for s in sels if s["selected"]["id"] == cid)
        )
        arch = catalog.model(model)
        for name, gpu in catalog.load_gpus().items():
            # the value is what `memfit fit --maximize seq_len` gives for that setup on that GPU type
            longest, _ = fit(arch, gpu, world, 1, method, cand, "seq_len", settings=SETTINGS)
            text, cls = cells[name][col]
            assert text.replace(",", "").removesuffix(" (max)") == (
                str(longest) if longest else "—"
            )
            want = "ok" if longest >= cand.seq_len else "short" if longest else "bad"
            assert cls.split()[0] == want, (name, model, method, text, cls)
            # the GPU types the setup was selected for are outlined
            picked = {
                s["gpu"]
                for s in sels
                if s["selected"]["id"] == cid and s["model"] == model and s["method"] == method
            }
            assert ("here" in cls.split()) == (name in picked)
    # an 80 GB GPU trains a 7-8B model at the selected length; a 16 GB V100 cannot at that length
    assert all(cls.startswith("ok") for _, cls in cells["h100-80gb"])
    assert not any(cls.startswith("ok") for _, cls in cells["v100-16gb"])
