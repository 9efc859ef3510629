"""Measurements belong to what they measured (issue #41), as a user meets it: a config that asks
for a GPU, run on a machine without one, stops before anything is measured, naming `gpus`."""

import subprocess
import sys

import pytest
import torch
import yaml

CHECKOUT = ("Snakefile", "workflow", "config", "data", "src", "envs")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
@pytest.mark.parametrize("calibrate", [True, False])
def test_a_gpu_config_on_a_machine_without_one_stops_before_measuring(repo, tmp_path, demo_model, calibrate):
    for name in CHECKOUT:
        (tmp_path / name).symlink_to(repo / name)
    cfg = yaml.safe_load((repo / "config" / "config.yaml").read_text())
    cfg.update(gpus=["h100-80gb"], methods=["sft"], estimate={"activations": "analytic"})
    cfg["models"] = {"demo-tiny": {"path": str(demo_model)}}  # built once per session (conftest), not by the DAG
    cfg["probe"]["calibrate"] = calibrate
    (tmp_path / "gpu.yaml").write_text(yaml.safe_dump(cfg))
    res = subprocess.run(
        [sys.executable, "-m", "snakemake", "--nolock", "--cores", "2", "--configfile", "gpu.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-3000:]
    stage = "calibrate" if calibrate else "probe_candidate"
    assert (
        f"memfit: NoTargetDevice: gpus: [h100-80gb] asks for a GPU, but this machine has none that CUDA can use, "
        f"and plan_only is off: {stage} would measure the CPU" in out
    ), out[-3000:]
    assert "`plan_only: true`" in out and "`gpus: [cpu]`" in out
    run = tmp_path / "results" / "demo-tiny" / "h100-80gb"
    assert not (run / "calibration.json").exists()
    assert not list(run.glob("sft/probes/*.json")) and not (run / "sft" / "selected.json").exists()


@pytest.mark.slow
def test_a_real_probe_records_its_device_and_the_selection_holds_it_to_the_gpu(demo_model, demo_data, tmp_path):
    """2 CPU ranks probe the demo model: the result names the device ("cpu", host memory) and the
    steady steps; select_config takes it for `gpus: [cpu]` and refuses it for an H100."""
    from deepspeed_runs import base_run

    from memfit.estimate.selection import WrongDevice, check_probe_files
    from memfit.workflow.probe import run_probe

    cfg = base_run(demo_model, demo_data, tmp_path / "run", zero=0, micro_batch=4, grad_accum=1)
    out = tmp_path / "probes" / "z0.json"
    out.parent.mkdir()
    res = run_probe(cfg, nproc=2, out_json=out, log=tmp_path / "probe.log", steps=3)
    assert res["status"] == "ok", res
    assert res["device_name"] == "cpu" and res["device_total_bytes"] > 2**30
    assert len(res["steady_step_times_s"]) == 2 and all(t > 0 for t in res["steady_step_times_s"])
    check_probe_files([str(out)], "cpu")
    with pytest.raises(WrongDevice, match=r"probes/.*\.json ran on the CPU, not on h100-80gb"):
        check_probe_files([str(out)], "h100-80gb")
