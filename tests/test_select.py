import json
from pathlib import Path

import pytest

from memfit.estimate.rows import Budget
from memfit.estimate.selection import choose, judge

MiB = 2**20


def est(cid, micro, dev_mib, step_s, fits=True, invalid=False, reason=""):
    cand = {"micro_batch": micro, "grad_accum": 8 // micro, "seq_len": 32}
    return {
        "id": cid,
        "candidate": cand,
        "peak_allocated_bytes": dev_mib * MiB,
        "peak_reserved_bytes": dev_mib * MiB,
        "device_total_bytes": dev_mib * MiB,
        "host_bytes": 100 * MiB,
        "step_time_s": step_s,
        "fits": fits,
        "invalid": invalid,
        "reason": reason,
    }


def probe(cid, status="ok", alloc_mib=0, step_s=1.0):
    return {
        "id": cid,
        "status": status,
        "peak_allocated_bytes": alloc_mib * MiB,
        "peak_reserved_bytes": None,
        "host_rss_bytes_node": 500 * MiB,
        "step_time_s": step_s,
        "error": "CUDA out of memory" if status == "oom" else "",
    }


BUDGET = Budget(device_bytes=100 * MiB, host_bytes=1024 * MiB, headroom=0.1)


def test_fastest_measured_candidate_that_fits_wins_and_every_loser_has_a_reason():
    estimates = [est("a", 1, 40, 1.0), est("b", 2, 60, 0.5), est("c", 4, 85, 0.2), est("d", 8, 85, 0.1)]
    probes = {
        "a": probe("a", alloc_mib=42, step_s=1.0),
        "b": probe("b", alloc_mib=70, step_s=0.6),
        "c": probe("c", alloc_mib=95, step_s=0.3),  # measured over the 90 MiB limit
    }
    best, ranked = choose(judge(estimates, probes, BUDGET, world=2, method="sft"))
    assert best.id == "b"
    reasons = {r.id: r.reason for r in ranked}
    assert reasons["b"].startswith("selected")
    assert reasons["a"].startswith("slower")
    assert "does not fit" in reasons["c"] and "measured" in reasons["c"]
    assert reasons["d"].startswith("not probed")  # predicted to fit, yet measured beats predicted
    assert ranked[0].id == "b"


def test_oom_probe_is_a_loss_not_a_crash():
    estimates = [est("a", 1, 40, 1.0), est("b", 2, 60, 0.5)]
    probes = {"a": probe("a", alloc_mib=42), "b": probe("b", status="oom")}
    best, ranked = choose(judge(estimates, probes, BUDGET, world=1, method="dpo"))
    assert best.id == "a"
    assert "probe oom" in next(r for r in ranked if r.id == "b").reason


def test_without_probes_the_prediction_decides_and_invalid_rows_say_why():
    estimates = [
        est("a", 1, 40, 1.0),
        est("b", 2, 95, 0.1),
        est("v", 2, 10, 0.01, invalid=True, reason="no bf16 on v100"),
    ]
    best, ranked = choose(judge(estimates, {}, BUDGET, world=1, method="sft"))
    assert best.id == "a" and best.source == "predicted"
    assert "cannot run here: no bf16 on v100" in next(r for r in ranked if r.id == "v").reason


def test_nothing_fits_names_every_candidate():
    estimates = [est("a", 1, 400, 1.0), est("b", 2, 600, 0.5)]
    with pytest.raises(RuntimeError, match=r"no candidate fits(.|\n)*a: does not fit(.|\n)*b: does not fit"):
        choose(judge(estimates, {}, BUDGET, world=1, method="sft"))


def test_rows_round_trip_and_a_bad_row_names_its_key():
    from memfit.estimate.rows import CandidateRow, RowError, Selection

    for case in SELECT_CASES:  # every row the fixtures hold reads back to the same JSON
        doc = json.loads((FIXTURES / f"{case}.selected.expected.json").read_text())
        assert Selection.from_json(doc).to_json() == doc, case
    sel = Selection.from_json(doc)  # the mixed case: every verdict source
    assert sel.to_json() == doc and sel.selected.id == doc["selected"]["id"]
    assert {r.source for r in sel.candidates} == {"measured", "probe", "predicted", "rule"}
    bad = json.loads(json.dumps(doc))
    bad["candidates"][2]["fits"] = "yes"
    with pytest.raises(RowError, match=r"^candidates\[2\]\.fits: expected bool, got 'yes'"):
        Selection.from_json(bad)
    del bad["candidates"][2]["predicted"]
    with pytest.raises(RowError, match=r"candidates\[2\]\.predicted: missing"):
        CandidateRow.from_json(bad["candidates"][2], "candidates[2]")
    with pytest.raises(RowError, match=r"candidates.json rows\[0\]\.candidate: missing"):
        judge([{"id": "a"}], {}, BUDGET, world=1, method="sft")


def test_probes_keep_a_low_memory_fallback():
    from memfit.workflow.pipeline import probe_choice

    ranked = [
        {"id": "fast", "device_total_bytes": 90},
        {"id": "second", "device_total_bytes": 80},
        {"id": "third", "device_total_bytes": 85},
        {"id": "small", "device_total_bytes": 10},
    ]
    assert probe_choice(ranked, 3) == ["fast", "second", "small"]
    assert probe_choice(ranked, 1) == ["fast"]
    assert probe_choice(ranked[:2], 4) == ["fast", "second"]
    assert probe_choice([], 3) == []


def test_dpo_probes_the_reference_model_twin_of_the_first_precomputed_probe():
    from memfit.workflow.pipeline import reference_twin

    def row(cid, ref, zero=2, invalid=False):
        return {"id": cid, "invalid": invalid, "candidate": {"zero": zero, "micro_batch": 8, "ref": ref}}

    rows = [
        row("z3-pre", "precomputed", 3),
        row("z2-pre", "precomputed"),
        row("z2-model", "model"),
        row("z3-model", "model", 3, invalid=True),
    ]
    # z3's twin is invalid, so the pair comes from the next probe
    assert reference_twin(rows, ["z3-pre", "z2-pre"]) == {"precomputed": "z2-pre", "model": "z2-model"}
    assert reference_twin(rows, ["z2-model"]) is None  # already a model reference: nothing to compare
    assert reference_twin([row("a", "precomputed")], ["a"]) is None  # no ref=model in the space


def test_ranking_puts_measured_before_predicted():
    estimates = [est("a", 1, 40, 1.0), est("b", 2, 60, 0.01), est("c", 4, 50, 0.5)]
    probes = {"a": probe("a", alloc_mib=42, step_s=1.0), "c": probe("c", alloc_mib=50, step_s=2.0)}
    best, ranked = choose(judge(estimates, probes, BUDGET, world=1, method="sft"))
    assert [r.id for r in ranked] == ["a", "c", "b"]  # b is predicted fastest but never measured


FIXTURES = Path(__file__).parent / "fixtures" / "select"
# name -> (inputs directory, method, plan_only); the expected files were written by the code before
# selection rows were typed (commit "select fixtures"), and sft/dpo equal the demo's selected.json
SELECT_CASES = {
    "sft": ("sft", "sft", False),
    "dpo": ("dpo", "dpo", False),
    "plan_only": ("dpo", "dpo", True),
    "mixed": ("mixed", "sft", False),
}


@pytest.mark.parametrize("case", sorted(SELECT_CASES))
def test_selected_json_is_byte_for_byte_what_it_was(case, repo, tmp_path, monkeypatch):
    """Other stages and users read selected.json: the same inputs must give the same bytes."""
    import yaml

    from memfit.workflow.pipeline import select_config

    inputs, method, plan_only = SELECT_CASES[case]
    config = yaml.safe_load((repo / "config" / "config.yaml").read_text()) | {"plan_only": plan_only}
    probes = [] if plan_only else sorted(str(p) for p in (FIXTURES / inputs / "probes").glob("*.json"))
    monkeypatch.chdir(tmp_path)  # the launch command names run.json by the relative path Snakemake gives
    run_dir = f"results/demo-tiny/cpu/{method}"
    out = {
        "selected": f"{run_dir}/selected.json", "ds_config": f"{run_dir}/ds_config.json",
        "run": f"{run_dir}/run.json", "launch": f"{run_dir}/launch.sh",
    }  # fmt: skip
    select_config(config, "demo-tiny", "cpu", method, str(FIXTURES / inputs / "candidates.json"), probes,
                  "results/demo-tiny/model", f"results/demo-tiny/data/{method}", f"{run_dir}/train", out)  # fmt: skip
    assert (tmp_path / out["selected"]).read_bytes() == (FIXTURES / f"{case}.selected.expected.json").read_bytes()


def test_nothing_fits_names_the_closest_and_round_trips_as_a_selection():
    from memfit.estimate.rows import RowError, Selection
    from memfit.estimate.selection import NoneFits

    # b is over by 33% on the device, a by 11% on the host: a is the closest
    estimates = [est("b", 2, 120, 0.5), est("a", 1, 40, 1.0), est("v", 1, 1, 1.0, invalid=True, reason="no bf16")]
    estimates[1]["host_bytes"] = 1137 * MiB
    with pytest.raises(NoneFits) as info:
        choose(judge(estimates, {}, BUDGET, world=1, method="sft"), BUDGET)
    e = info.value
    assert [r.id for r in e.rows] == ["a", "b", "v"]
    assert e.reason.startswith(
        "no candidate fits the budget (3 candidates, 1 of them cannot run here); the closest, a: host RAM"
    )
    assert "Widen the search space" in e.reason and "  v: cannot run here: no bf16" in str(e)
    doc = {"model": "m", "gpu": "g", "method": "sft", "selected": None, "none_fits": e.reason,
           "budget": {"device_bytes": 1, "host_bytes": 1, "headroom": 0.1}, "plan_only": True, "launch": None,
           "candidates": [r.to_json() for r in e.rows]}  # fmt: skip
    sel = Selection.from_json(doc)
    assert sel.selected is None and sel.none_fits == e.reason and sel.to_json() == doc
    with pytest.raises(RowError, match="selected: missing"):
        Selection.from_json(doc | {"none_fits": None})


# -- measurements belong to what they measured (issue #41) ------------------------------------
def write_probes(tmp_path, **devices):
    """Probe files as the probe_candidate rule writes them, each with the device it ran on."""
    paths = []
    for cid, (name, total) in devices.items():
        p = tmp_path / f"{cid}.json"
        d = probe(cid, alloc_mib=40) | {"device": "cpu" if name == "cpu" else "cuda:0"}
        p.write_text(json.dumps(d | {"device_name": name, "device_total_bytes": total}))
        paths.append(str(p))
    return paths


def test_a_probe_of_another_device_is_refused_naming_both(tmp_path):
    from memfit.estimate.selection import WrongDevice, check_probe_files

    cpu = write_probes(tmp_path, a=("cpu", 16 * 2**30))
    with pytest.raises(WrongDevice) as e:
        check_probe_files(cpu, "h100-80gb")
    msg = str(e.value)
    assert msg.startswith("gpus: [h100-80gb]: a probe counts only for the device it ran on")
    assert "probes/a.json ran on the CPU, not on h100-80gb" in msg and "plan_only: true" in msg
    a100 = write_probes(tmp_path, b=("NVIDIA A100-SXM4-80GB", 81920 * MiB))
    with pytest.raises(WrongDevice, match=r"probes/b.json ran on NVIDIA A100-SXM4-80GB \(a100-80gb\), not on h100"):
        check_probe_files(a100, "h100-80gb")
    h100 = write_probes(tmp_path, c=("NVIDIA H100 80GB HBM3", 81559 * MiB))
    check_probe_files(h100 + cpu[:0], "h100-80gb")  # the configured GPU: accepted
    check_probe_files(cpu, "cpu")
    # judge refuses the same way when it is told the GPU
    with pytest.raises(WrongDevice):
        judge([est("a", 1, 40, 1.0)], {"a": json.loads(Path(cpu[0]).read_text())}, BUDGET, 1, "sft", gpu="a100-80gb")


def test_no_gpu_here_stops_a_gpu_config_before_it_measures(monkeypatch):
    import torch

    from memfit.workflow.probe import NoTargetDevice, require_target_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(NoTargetDevice) as e:
        require_target_device("h100-80gb", plan_only=False, stage="probe_candidate")
    msg = str(e.value)
    assert msg.startswith("gpus: [h100-80gb] asks for a GPU, but this machine has none that CUDA can use")
    assert "probe_candidate would measure the CPU" in msg
    assert "`plan_only: true`" in msg and "`gpus: [cpu]`" in msg and "`gpus: [detect]`" in msg
    require_target_device("h100-80gb", plan_only=True, stage="probe_candidate")  # a plan measures nothing
    require_target_device("cpu", plan_only=False, stage="probe_candidate")


def timed_probe(cid, alloc_mib, step_s, steady=None):
    return probe(cid, alloc_mib=alloc_mib, step_s=step_s) | {
        "device": "cpu",
        "device_name": "cpu",
        "steady_step_times_s": steady or [step_s, step_s],
    }


def test_within_the_noise_the_tie_rule_decides_and_selected_json_says_so():
    # b is 10% faster than a but uses more memory: within the CPU's 20%, so less memory wins
    estimates = [est("a", 1, 40, 1.0), est("b", 1, 60, 1.0)]
    probes = {"a": timed_probe("a", 42, 1.1), "b": timed_probe("b", 70, 1.0)}
    best, ranked = choose(judge(estimates, probes, BUDGET, world=1, method="sft"))
    assert best.id == "a"
    d = best.to_json()["decision"]
    assert d["by"] == "tie rule" and d["runner_up"] == "b" and d["tied"] == ["a", "b"]
    assert d["margin"] == pytest.approx(1.0 / 1.1 - 1, abs=1e-6) and d["noise"] == 0.2
    assert d["tie_rule"].startswith("less device memory, then fewer levers")
    assert next(r for r in ranked if r.id == "b").reason.startswith("tied: ")
    # 30% apart: speed decides, with its margin over the runner-up
    probes["a"] = timed_probe("a", 42, 1.3)
    best, _ = choose(judge(estimates, probes, BUDGET, world=1, method="sft"))
    assert best.id == "b" and best.reason == "selected: fastest that fits"
    assert best.decision["by"] == "speed" and best.decision["margin"] == pytest.approx(0.3)


def test_a_probe_spread_wider_than_the_stated_noise_widens_the_tie():
    estimates = [est("a", 1, 40, 1.0), est("b", 1, 60, 1.0)]
    # 30% apart, but b's own steps ranged 1.0 .. 1.5 s: a 50% spread, so not told apart
    probes = {"a": timed_probe("a", 42, 1.3), "b": timed_probe("b", 70, 1.0, steady=[1.0, 1.0, 1.5])}
    best, _ = choose(judge(estimates, probes, BUDGET, world=1, method="sft"))
    assert best.id == "a" and best.decision["by"] == "tie rule" and best.decision["noise"] == pytest.approx(0.5)


def test_a_gpu_of_another_kind_stops_a_config_before_it_measures(monkeypatch):
    import torch

    from memfit.estimate.models import detect
    from memfit.workflow.probe import NoTargetDevice, require_target_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(detect, "smi_devices", lambda: [("NVIDIA A100-SXM4-80GB", 81920)])
    with pytest.raises(NoTargetDevice) as e:
        require_target_device("h100-80gb", plan_only=False, stage="calibrate")
    assert str(e.value).startswith(
        "gpus: [h100-80gb] names a GPU this machine does not have: its GPU is NVIDIA A100-SXM4-80GB (a100-80gb, "
        "81920 MiB), and calibrate would measure it"
    )
    require_target_device("a100-80gb", plan_only=False, stage="calibrate")  # the GPU it has

    def no_smi():
        raise detect.DetectError("no nvidia-smi")

    monkeypatch.setattr(detect, "smi_devices", no_smi)
    require_target_device("h100-80gb", plan_only=False, stage="calibrate")  # cannot tell: the selection checks


def test_a_probed_lever_candidate_is_probed_beside_its_plain_twin():
    """A compiled, padding-free or liger candidate the ranking probes brings its plain twin into the
    probes (when it fits), so the selection decides the lever by two measurements."""
    from memfit.workflow.pipeline import lever_twins

    def row(cid, fits=True, invalid=False, **levers):
        cand = {"zero": 0, "micro_batch": 16, "compile": False, "padding_free": False, "kernels": "none"}
        return {"id": cid, "fits": fits, "invalid": invalid, "candidate": cand | levers}

    rows = [
        row("z0-compiled", compile=True),
        row("z0-pf-compiled", compile=True, padding_free=True),
        row("z0-liger", kernels="liger"),
        row("z0"),
    ]
    assert lever_twins(rows, ["z0-compiled", "z0-pf-compiled"]) == ["z0"]  # one twin for both
    assert lever_twins(rows, ["z0-liger", "z0"]) == []  # the twin is probed already
    assert lever_twins(rows, ["z0"]) == []  # no lever: nothing to add
    assert lever_twins([*rows[:3], row("z0", fits=False)], ["z0-compiled"]) == []  # a twin that won't fit
    assert lever_twins(rows[:3], ["z0-compiled"]) == []  # no plain twin in the space
