"""Resume on a different number of ranks (DeepSpeed universal checkpoint) and the host-RAM check
before a resume. The end-to-end tests run real DeepSpeed on the CPU accelerator (gloo)."""

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from deepspeed_runs import base_run, run
from safetensors.torch import load_file

from memfit.train import checkpoint, checkpoint_compat, resume_ram
from memfit.train.batches import Schedule, rank_batches
from memfit.train.loop import Run
from memfit.train.run_config import RunConfig


# --------------------------------------------------------------------------- fast: no DeepSpeed
def meta_for(world, **cand):
    c = {"zero": 2, "micro_batch": 4, "grad_accum": 1, **cand}
    return {"world_size": world, "step": 3, "run_config": {"seed": 0, "candidate": c}}


def now(**cand):
    return {"seed": 0, "candidate": {"zero": 2, "micro_batch": 4, "grad_accum": 1, **cand}}


def test_a_world_size_change_keeping_the_global_batch_is_resumable():
    where = Path("ck/step00000003")
    assert checkpoint.check_compatible(meta_for(2), now(), where, world=2) == checkpoint.SAME
    assert checkpoint.check_compatible(meta_for(2), now(grad_accum=2), where, world=1) == checkpoint.UNIVERSAL_LOAD
    assert checkpoint.check_compatible(meta_for(1, grad_accum=2), now(), where, world=2) == checkpoint.UNIVERSAL_LOAD
    z3 = {"zero": 3, "offload_optimizer": "cpu"}  # full optimizer offload converts like the rest
    assert (
        checkpoint.check_compatible(meta_for(2, **z3), now(grad_accum=2, **z3), where, world=1)
        == checkpoint.UNIVERSAL_LOAD
    )
    # ZeRO-0 partitions nothing: DeepSpeed's plain load reads it on any number of ranks
    assert (
        checkpoint.check_compatible(meta_for(2, zero=0), now(zero=0, grad_accum=2), where, world=1)
        == checkpoint_compat.DIRECT
    )


def test_a_world_size_change_that_changes_the_global_batch_is_refused():
    with pytest.raises(
        ValueError,
        match=r"global batch: checkpoint 8 \(world size 2\) != now 4 \(world size 1\); "
        r"with 1 ranks grad_accum must be 2 to keep the data order\n"
        r"\(written by 2 ranks, now 1, ZeRO-2: ",
    ):
        checkpoint.check_compatible(meta_for(2), now(), Path("ck/step00000003"), world=1)
    with pytest.raises(ValueError, match=r"now 12 \(world size 3\); no grad_accum keeps it \(8 is not a multiple"):
        checkpoint.check_compatible(meta_for(2), now(), Path("ck/step00000003"), world=3)
    # grad_accum may only differ when the world size does
    with pytest.raises(ValueError, match=r"candidate.grad_accum: checkpoint 1 != now 2"):
        checkpoint.check_compatible(meta_for(2), now(grad_accum=2), Path("ck/step00000003"), world=2)


def test_partial_offload_zero3_on_another_world_size_is_refused_naming_both_sizes_and_the_stage():
    z3 = {"zero": 3, "offload_optimizer": "cpu", "offload_ratio": 0.5}
    with pytest.raises(
        ValueError,
        match=r"ck/step00000003 was written by 2 ranks and cannot be resumed on 1: "
        r"ZeRO-3 with partial optimizer offload \(offload_ratio 0.5\)",
    ):
        checkpoint.check_compatible(meta_for(2, **z3), now(grad_accum=2, **z3), Path("ck/step00000003"), world=1)


def test_the_global_sample_order_does_not_depend_on_the_world_size():
    """Micro batch j of a step is rows [j*micro, (j+1)*micro) of the step's slice of the epoch's
    permutation, whichever rank and accumulation step runs it (j = m * world + rank)."""

    def step_micro_batches(world, accum, step):
        s = Schedule(100, micro=4, accum=accum, world=world, seed=7)
        out = {}
        for rank in range(world):
            for m, idx in enumerate(s.micro_batches(step, rank)):
                out[m * world + rank] = idx
        return [out[j] for j in sorted(out)]

    for step in (0, 5, 12, 13):  # 12 steps per epoch: 13 is in the second epoch
        two_ranks, one_rank = step_micro_batches(2, 1, step), step_micro_batches(1, 2, step)
        assert two_ranks == one_rank
        assert len(np.unique(np.concatenate(one_rank))) == 8
    assert step_micro_batches(2, 1, 0) != step_micro_batches(2, 1, 12)  # a fresh permutation per epoch


def test_eval_batches_do_not_depend_on_the_world_size():
    """Which held-out rows share a micro batch decides padding and the per-batch token mean, so it
    must not depend on the number of ranks (a run resumed on another world evaluates the same)."""
    rows = [{"i": i} for i in range(11)]

    def batches(world):
        out = []
        for rank in range(world):
            got = list(rank_batches(rows, 4, world, rank))
            out.append(got)
            assert len(got) == len(out[0])  # every rank runs the same number of forwards (ZeRO-3)
        return sorted(idx for per_rank in out for idx, _ in per_rank if idx)

    assert batches(1) == batches(2) == batches(3) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]


class RecordingEngine:
    optimizer = None  # no DeepSpeed optimizer: nothing for memfit.train.adam_steps to replay

    def __init__(self):
        self.loaded = []

    def load_checkpoint(self, *args, **kwargs):
        self.loaded.append((args, kwargs))
        return args[0], {}

    def load_universal_checkpoint(self):
        return False


class ShardWriter:
    """Writes the files DeepSpeed's ZeRO-2 save writes for 2 ranks, with known sizes."""

    def save_checkpoint(self, root, tag, client_state, save_latest):
        d = Path(root) / tag
        d.mkdir(parents=True, exist_ok=True)
        torch.save({"module": torch.zeros(2000), **client_state}, d / "mp_rank_00_model_states.pt")
        for r in range(2):
            torch.save({"m": torch.zeros(3000)}, d / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")


def test_resume_host_ram_is_checked_before_anything_is_loaded(tmp_path, monkeypatch):
    """The needed RAM comes from the checkpoint's own file sizes; the available RAM from
    `resume_ram.mem_available_bytes` (MemAvailable), replaced here by a small value."""
    cfg = RunConfig(
        method="sft",
        model_path="m",
        data_dir="d",
        out_dir=str(tmp_path),
        candidate={"zero": 2, "micro_batch": 4, "grad_accum": 1},
    )
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    root = tmp_path / "checkpoints"
    checkpoint.save(ShardWriter(), root, 3, {"step": 3}, keep_last=2, run_config=dataclasses.asdict(cfg))
    tag = "step00000003"
    files = {p.name: p.stat().st_size for p in (root / tag).iterdir()}
    per_rank = files["mp_rank_00_model_states.pt"] + files["zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert resume_ram.resume_host_bytes(root, tag, checkpoint.SAME, "deepspeed") == {"per_rank": per_rank}
    # memfit's loader streams the files through one window: the files, or the window when smaller
    assert resume_ram.resume_host_bytes(root, tag, checkpoint.SAME) == {"per_rank": per_rank}
    monkeypatch.setattr(resume_ram, "CHECKPOINT_CHUNK_BYTES", per_rank // 4)
    assert resume_ram.resume_host_bytes(root, tag, checkpoint.SAME) == {"per_rank": per_rank // 4}
    monkeypatch.setattr(resume_ram, "CHECKPOINT_CHUNK_BYTES", 1 << 40)

    run = Run(cfg)
    run.engine = RecordingEngine()
    run.resume_plan = (root, tag, checkpoint.SAME)
    monkeypatch.setattr(resume_ram, "mem_available_bytes", lambda: 2 * per_rank - 1)
    with pytest.raises(
        checkpoint.CheckpointError,
        match=rf"not enough host RAM to resume from {root / tag}: loading it "
        r"\(2 ranks x 0.00 GiB .*\) needs 0.00 GiB on this node, "
        r"0.00 GiB available \(MemAvailable\)\. Nothing was loaded",
    ):
        run.maybe_resume()
    assert run.engine.loaded == []  # refused before DeepSpeed read a byte
    monkeypatch.setattr(resume_ram, "mem_available_bytes", lambda: 2 * per_rank)
    assert run.maybe_resume() == 3
    assert len(run.engine.loaded) == 1


def test_a_conversion_is_made_once_published_by_rename_and_redone_when_the_step_is_resaved(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    checkpoint.save(ShardWriter(), root, 3, {"step": 3}, keep_last=2, run_config={})
    made = []

    def convert(src, out):
        made.append(src)
        (out / "zero").mkdir(parents=True)
        torch.save({"param_groups": []}, out / "zero/optimizer_state.pt")

    monkeypatch.setattr(checkpoint, "_convert_to_universal", convert)
    dest = checkpoint.ensure_universal(root, "step00000003", log=lambda _m: None)
    assert dest == root / "universal/step00000003" and (dest / "zero/optimizer_state.pt").exists()
    assert (root / "universal/latest_universal").read_text() == "step00000003"
    checkpoint.ensure_universal(root, "step00000003", log=lambda _m: None)
    assert len(made) == 1  # reused
    assert checkpoint.complete_tags(root) == ["step00000003"]  # not taken for a checkpoint
    # a run resumed from an earlier step writes step 3 again: the old conversion goes with it
    checkpoint.save(ShardWriter(), root, 3, {"step": 3, "again": 1}, keep_last=2, run_config={})
    assert not dest.exists()
    checkpoint.ensure_universal(root, "step00000003", log=lambda _m: None)
    assert len(made) == 2
    # rotation removes a checkpoint's conversion with it
    for step in (4, 5):
        checkpoint.save(ShardWriter(), root, step, {"step": step}, keep_last=2, run_config={})
    assert not (root / "universal/step00000003").exists()


def test_a_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    checkpoint.save(ShardWriter(), root, 3, {"step": 3}, keep_last=2, run_config={})

    def convert(src, out):
        (out / "zero").mkdir(parents=True)
        raise AssertionError("Required universal_checkpoint_info state is missing")

    monkeypatch.setattr(checkpoint, "_convert_to_universal", convert)
    with pytest.raises(
        checkpoint.CheckpointError, match=r"converting .*step00000003 to a universal checkpoint failed: Required"
    ):
        checkpoint.ensure_universal(root, "step00000003", log=lambda _m: None)
    assert list((root / "universal").iterdir()) == []
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda _p: usage._replace(free=1000))
    with pytest.raises(
        checkpoint.CheckpointError, match=r"not enough disk to convert .*step00000003 .*GiB needed.*GiB free"
    ):
        checkpoint.ensure_universal(root, "step00000003", log=lambda _m: None)


def test_mem_available_reads_proc_meminfo():
    avail = resume_ram.mem_available_bytes()
    import psutil

    assert avail > 0 and abs(avail - psutil.virtual_memory().available) < 0.2 * avail


# --------------------------------------------------------------------------- real DeepSpeed runs
@pytest.fixture(scope="module")
def data(demo_data):
    return demo_data


def sft_run(demo_model, data, out, **cand):
    return base_run(demo_model, data, out, **{"micro_batch": 8, **cand})


def rows_of(rows, split):
    return [(r["step"], r["loss"]) for r in rows if r["split"] == split]


def interrupted_copy(src: Path, dest: Path, keep: str) -> None:
    """The run directory as a job killed after checkpoint `keep` would have left it."""
    shutil.copytree(src, dest)
    for d in (dest / "checkpoints").glob("step*"):
        if d.name > keep:
            shutil.rmtree(d)
    (dest / "checkpoints/latest").write_text(keep)
    shutil.rmtree(dest / "model")
    (dest / "summary.json").unlink()


@pytest.mark.slow
# ZeRO-2 2->1 (a universal checkpoint as ZeRO-3's, unpartitioned by the same conversion): the sweep
# (benchmarks/sweeps.sh)
@pytest.mark.parametrize(
    ("zero", "before", "after"), [pytest.param(2, 2, 1, marks=pytest.mark.sweep), (3, 2, 1), (0, 2, 1), (2, 1, 2)]
)
def test_a_checkpoint_resumes_on_another_number_of_ranks(demo_model, data, shared_runs, tmp_path, zero, before, after):
    """Global batch 16 = 8 micro x accum x ranks throughout; ZeRO-1/2/3 through a universal
    checkpoint, ZeRO-0 (nothing partitioned) as saved. The 2-rank runs resumed from are the
    session's shared ones (tests/deepspeed_runs.py `SharedRuns`, the same `base_run`)."""
    if before == 2:
        ref_dir, ref = shared_runs[f"sft-z{zero}"]
        ref_cfg = shared_runs.config(f"sft-z{zero}")
    else:
        ref_dir = tmp_path / "ref"
        ref_cfg = sft_run(demo_model, data, ref_dir, zero=zero, grad_accum=2 // before)
        ref = run(ref_cfg, before)
    out = tmp_path / "resumed"
    interrupted_copy(ref_dir, out, "step00000003")
    cfg = dataclasses.replace(ref_cfg, out_dir=str(out), candidate={**ref_cfg.candidate, "grad_accum": 2 // after})
    rows = run(cfg, after)
    log = (out / "log.txt").read_text()
    universal = zero > 0
    how = "universal checkpoint" if universal else "unpartitioned state"
    assert f"at step 3 (written by {before} ranks, now {after}: {how}" in log
    conv = out / "checkpoints/universal/step00000003"
    assert (conv / "zero/optimizer_state.pt").exists() == universal
    assert (conv / checkpoint.UNIVERSAL_SOURCE).exists() == universal
    assert not list((out / "checkpoints").glob("universal/.*.tmp"))
    assert [r["step"] for r in rows] == [r["step"] for r in ref]
    # steps up to the checkpoint come from the checkpoint's copy of the curve, unchanged
    assert [r for r in rows if r["step"] <= 3] == [r for r in ref if r["step"] <= 3]
    # after it: the same samples in the same micro batches, reduced over ranks or accumulated (fp32)
    for split in ("train", "eval"):
        got, want = rows_of(rows, split), rows_of(ref, split)
        assert [s for s, _ in got] == [s for s, _ in want]
        rel = max(abs(a - b) / abs(b) for (_, a), (_, b) in zip(got, want, strict=True))
        print(f"ZeRO-{zero} {before}->{after} ranks, {split} losses: max relative difference {rel:.2e}")
        assert rel < 1e-5, (split, got, want)
    a = load_file(str(ref_dir / "model/model.safetensors"))
    b = load_file(str(out / "model/model.safetensors"))
    worst = max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-12)) for k in a)
    print(f"ZeRO-{zero} {before}->{after} ranks, final weights: max relative difference {worst:.2e}")
    assert worst < 1e-4
    assert json.loads((out / "summary.json").read_text())["world_size"] == after
