"""memfit.train.dsconfig: the DeepSpeed JSON every probe and training run uses."""

import pytest
import torch
from deepspeed.runtime.lr_schedules import WarmupCosineLR

from memfit.space import Candidate
from memfit.train import dsconfig


def _lrs(warmup_steps: int, steps: int = 4) -> list[float]:
    """The learning rates DeepSpeed's own scheduler yields for the config memfit writes."""
    cfg = dsconfig.build(
        Candidate(zero=2, micro_batch=1),
        world_size=1,
        lr=1.0,
        total_steps=10,
        warmup_steps=warmup_steps,
    )
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = WarmupCosineLR(opt, **cfg["scheduler"]["params"])
    sched.step()  # as memfit.train.loop does after deepspeed.initialize
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_no_warmup_starts_at_the_peak_learning_rate():
    # DeepSpeed refuses warmup_num_steps=0, which a 1-step run (warmup capped at half the run) hit
    lrs = _lrs(0)
    assert lrs[0] == pytest.approx(1.0) and lrs[1] == pytest.approx(1.0)
    assert lrs[3] < lrs[2] < 1.0  # then the cosine decay


def test_linear_warmup_ramps_from_zero():
    # as transformers' get_cosine_schedule_with_warmup: the first step at 0, then up linearly;
    # DeepSpeed's cosine decay begins right after the warmup (lr_schedules.py get_lr_ratio)
    lrs = _lrs(2)
    assert lrs[:2] == pytest.approx([0.0, 0.5]) and 0.9 < lrs[2] < 1.0


# --------------------------------------------------------------------------- ds_config.json == what trains
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import yaml  # noqa: E402

from memfit.train.launch import launch_env  # noqa: E402
from memfit.train.run_config import RunConfig  # noqa: E402
from memfit.workflow import pipeline  # noqa: E402
from memfit.workflow.config import WorkflowConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# One rank of memfit's trainer in its own process: Run.setup() (data, schedule, DeepSpeed config,
# deepspeed.initialize), then the DeepSpeed config it initialised with.
TRAINER_DS = """
import json, sys
from memfit.train import dist
from memfit.train.loop import Run
from memfit.train.run_config import RunConfig
dist.init_distributed()
run = Run(RunConfig.load(sys.argv[1]))
run.setup()
json.dump({"ds_config": run.ds_config, "total_steps": run.total_steps}, open(sys.argv[2], "w"))
"""


def _demo_cfg(demo_model, **train) -> WorkflowConfig:
    raw = yaml.safe_load((REPO / "config/config.yaml").read_text())
    raw["models"] = {"demo-tiny": {"path": str(demo_model)}}
    raw["num_gpus"] = 1  # the trainer below runs one rank in this process's child
    raw["data"] |= {
        "max_len": 32,
        "sft": str(REPO / "data/demo/sft.jsonl"),
        "dpo": str(REPO / "data/demo/dpo.jsonl"),
    }
    raw["estimate"] = {"activations": "analytic"}
    raw["train"]["sft"] |= train
    return WorkflowConfig.load(raw)


def _select(cfg: WorkflowConfig, demo_model, data_dir, run_dir: Path) -> dict:
    pipeline.estimate_candidates(cfg, "demo-tiny", "cpu", "sft", run_dir / "candidates.json")
    out = {
        k: run_dir / f
        for k, f in (
            ("selected", "selected.json"),
            ("ds_config", "ds_config.json"),
            ("run", "run.json"),
            ("launch", "launch.sh"),
        )
    }
    return pipeline.select_config(
        cfg,
        "demo-tiny",
        "cpu",
        "sft",
        run_dir / "candidates.json",
        [],
        str(demo_model),
        str(data_dir),
        str(run_dir / "train"),
        out,
    )


@pytest.mark.slow  # one DeepSpeed rank under torchrun: 15 s idle, minutes on a loaded machine
@pytest.mark.parametrize("packing", [False, True], ids=["rows", "packed"])
def test_select_configs_ds_config_is_the_one_the_trainer_initialises(demo_model, demo_data, tmp_path, packing):
    """Before, select_config wrote total_num_steps=1 while training ran epochs x steps_per_epoch."""
    cfg = _demo_cfg(demo_model, packing=packing, epochs=1.5)
    run_dir = tmp_path / "demo-tiny/cpu/sft"
    _select(cfg, demo_model, demo_data / "sft", run_dir)
    written = json.loads((run_dir / "ds_config.json").read_text())

    script, got = tmp_path / "trainer_ds.py", tmp_path / "trainer.json"
    script.write_text(TRAINER_DS)
    env = launch_env(threads_per_rank=1) | {"PYTHONPATH": str(REPO / "src")}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "1",
            str(script),
            str(run_dir / "run.json"),
            str(got),
        ],
        env=env,
        check=True,
        timeout=900,
        capture_output=True,
    )
    trainer = json.loads(got.read_text())
    assert trainer["ds_config"] == written
    steps = written["scheduler"]["params"]["total_num_steps"]
    assert steps == trainer["total_steps"] > 1
    # 1.5 epochs of the train rows (or packs) at the global batch of 32, the tail of an epoch skipped
    units = dsconfig.training_units(demo_data / "sft", packing, seq_len=32, seed=0)
    rows = json.loads((demo_data / "sft/stats.json").read_text())["rows_kept"]["train"]
    assert (units < rows) if packing else (units == rows)
    assert steps == int(1.5 * (units // 32))
    assert written["scheduler"]["params"]["warmup_num_steps"] == min(10, steps // 2)


def test_a_plan_without_prepared_data_leaves_the_step_count_to_the_trainer_that_runs_it(demo_model, tmp_path):
    cfg = _demo_cfg(demo_model)
    run_dir = tmp_path / "demo-tiny/cpu/sft"
    _select(cfg, demo_model, tmp_path / "not-prepared", run_dir)
    params = json.loads((run_dir / "ds_config.json").read_text())["scheduler"]["params"]
    # the HF Trainer fills these in (exports/hf, exports/llamafactory)
    assert params["total_num_steps"] == params["warmup_num_steps"] == "auto"
    total, info = dsconfig.planned_steps(RunConfig.load(run_dir / "run.json"), 1)
    assert total is None and "not-prepared" in info["source"]
    # max_steps needs no data; warmup is capped at half the run
    cfg = _demo_cfg(demo_model, max_steps=7)
    _select(cfg, demo_model, tmp_path / "not-prepared", run_dir)
    params = json.loads((run_dir / "ds_config.json").read_text())["scheduler"]["params"]
    assert (params["total_num_steps"], params["warmup_num_steps"]) == (7, 3)
    assert RunConfig.load(run_dir / "run.json").max_steps == 7
