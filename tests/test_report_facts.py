"""Run facts, exports and the estimator-accuracy scatter on the report page."""

from __future__ import annotations

import hashlib
import importlib.metadata
import re
from pathlib import Path

from test_report import _dpo_run, _render, _text


def test_versions_config_hash_and_wall_time_per_rule(tmp_path: Path):
    paths = _dpo_run(tmp_path)
    cfg = tmp_path / "config" / "config.yaml"
    cfg.parent.mkdir()
    cfg.write_text("models: [demo-tiny]\n")
    bench = tmp_path / "benchmarks" / "demo-tiny" / "cpu" / "dpo"
    (bench / "probes").mkdir(parents=True)
    head = "s\th:m:s\tmax_rss\tmax_vms\n"
    (bench / "train.tsv").write_text(head + "179.40\t0:02:59\t900.5\t2000\n")
    (bench / "probes" / "z0-a.tsv").write_text(head + "10.00\t0:00:10\t500\t900\n")
    (bench / "probes" / "z2-b.tsv").write_text(head + "5.50\t0:00:05\tNA\t900\n")
    text = _text(_render(tmp_path, paths))
    facts = text[text.index("Run facts") :]
    assert f"torch {importlib.metadata.version('torch')}" in facts
    assert f"deepspeed {importlib.metadata.version('deepspeed')}" in facts
    assert "snakemake" in facts and "git commit" in facts
    assert f"config/config.yaml sha256 {hashlib.sha256(cfg.read_bytes()).hexdigest()[:16]}" in facts
    # probes are one rule (probe_candidate), summed over candidates: 10 s + 5.5 s
    assert re.search(r"train 179\.4 s .*probe_candidate 15\.5 s", facts)
    assert "demo-tiny/cpu/dpo/probes/z0-a" in facts and "900 MB" in facts


def test_launch_files_and_exports_beside_selected_json_are_shown(tmp_path: Path):
    paths = _dpo_run(tmp_path)
    run_dir = paths["selected"].parent
    (run_dir / "llamafactory.yaml").write_text("stage: dpo\ndeepspeed: ds_config.json <x>\n")
    (run_dir / "launch.sh").write_text("#!/bin/sh\nmemfit launch --nproc 2\n")
    page = _render(tmp_path, paths)
    text = _text(page)
    assert "llamafactory.yaml" in text and "launch.sh" in text
    assert "deepspeed: ds_config.json &lt;x&gt;" in page  # escaped, shown verbatim
    assert "<details>" in page
    assert "candidates.json (" not in text  # bookkeeping, not an export


def test_predicted_vs_measured_scatter_only_where_probes_measured(tmp_path: Path):
    page = _render(tmp_path / "run", _dpo_run(tmp_path / "run"))
    # the winner: predicted 150 MiB allocated, probe measured 160 MiB; the OOM probe has no figure
    assert 'alt="predicted vs measured peak, demo-tiny · cpu · dpo"' in page
    assert "1 probed candidate(s); the largest miss is 6% of the measured peak" in _text(page)
    plan = _render(tmp_path / "plan", _dpo_run(tmp_path / "plan", plan_only=True))
    assert "predicted vs measured peak" not in plan


def _longest(text: str, gpu: str) -> int:
    m = re.search(rf"\b{re.escape(gpu)} \d+ GiB ([\d,]+)", text)
    assert m, f"no fit-map row for {gpu}"
    return int(m.group(1).replace(",", ""))


def test_fit_map_longest_sequence_per_gpu_type_for_a_catalog_model(tmp_path: Path):
    import json

    paths = _dpo_run(tmp_path)
    sel = json.loads(paths["selected"].read_text())
    sel["model"] = "qwen2.5-0.5b"
    paths["selected"].write_text(json.dumps(sel))
    text = _text(_render(tmp_path, paths))
    fit = text[text.index("What hardware fits") :]
    # more memory never shortens the longest trainable sequence of the same configuration
    assert _longest(fit, "h200") >= _longest(fit, "h100-80gb") >= _longest(fit, "a100-40gb") > 0
    assert "seq len 32" in fit  # the grid's legend: the selected configuration's length


def test_fit_map_says_why_it_is_missing(tmp_path: Path):
    text = _text(_render(tmp_path, _dpo_run(tmp_path)))  # demo-tiny: no catalog card, no run.json
    assert "No fit map for demo-tiny · cpu · dpo" in text


def test_run_facts_hold_this_runs_benchmarks_only(tmp_path: Path):
    """A clone with a named run beside the default one (`run: qlora` writes benchmarks/qlora/...):
    each report's "Run facts" sum only its own run's rule times."""
    from memfit.report.facts import run_facts

    head = "s\th:m:s\tmax_rss\tmax_vms\n"
    mine = tmp_path / "benchmarks" / "demo-tiny" / "cpu" / "sft"
    other = tmp_path / "benchmarks" / "qlora" / "demo-tiny" / "cpu" / "sft"
    for folder, secs in ((mine, "100.0"), (other, "7.0")):
        folder.mkdir(parents=True)
        (folder / "train.tsv").write_text(head + f"{secs}\t0:01:40\t900\t2000\n")
    default = run_facts(tmp_path, models={"demo-tiny"})
    assert dict(default["per_rule"]) == {"train": 100.0}
    named = run_facts(tmp_path, tmp_path / "benchmarks" / "qlora", {"demo-tiny"})
    assert dict(named["per_rule"]) == {"train": 7.0}
    assert [target for _, target, _, _ in named["benchmarks"]] == ["demo-tiny/cpu/sft"]


def test_an_openrlhf_script_for_a_method_it_cannot_train_is_labelled_so(tmp_path: Path):
    """ORPO has no OpenRLHF trainer: its export only says so, and the report's label says that too."""
    from memfit import exports
    from memfit.report.facts import launch_files

    run_dir = tmp_path / "demo-tiny" / "cpu" / "orpo"
    script = exports.paths(run_dir, "orpo")["openrlhf"]
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\necho 'OpenRLHF 0.11.2 has no ORPO trainer' >&2\nexit 2\n")
    labels = {p.name: what for p, what in launch_files(run_dir, "orpo")}
    assert labels[script.name] == "OpenRLHF has no orpo trainer: the script says why and exits 2"
    dpo_script = exports.paths(tmp_path / "dpo", "dpo")["openrlhf"]
    dpo_script.parent.mkdir(parents=True)
    dpo_script.write_text("#!/bin/sh\ndeepspeed --module openrlhf.cli.train_dpo\n")
    dpo = {p.name: what for p, what in launch_files(tmp_path / "dpo", "dpo")}
    assert dpo[dpo_script.name].startswith("OpenRLHF command")
