"""OOM fallback in training (memfit.workflow.fallback): which candidate comes next, which checkpoints it may
continue, and that a save cut short by an OOM leaves nothing that passes for a checkpoint."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from memfit.space import Candidate
from memfit.train import checkpoint
from memfit.train.memory import AllocationTracker
from memfit.train.run_config import RunConfig
from memfit.workflow import fallback

WORLD = 2
SELECTED = {"zero": 0, "micro_batch": 16, "grad_accum": 1, "seq_len": 32, "precision": "fp32"}


def cand(**kw):
    return Candidate.from_dict({**SELECTED, **kw}).to_dict()


def row(c, fits=True, device_bytes=None, source="measured"):
    return {
        "id": Candidate.from_dict(c).id,
        "candidate": c,
        "fits": fits,
        "device_bytes": device_bytes,
        "source": source,
    }


# --------------------------------------------------------------------------- same training dynamics
def test_levers_keep_the_dynamics_and_the_global_batch_must_stay():
    base = cand()
    same = cand(
        zero=3,
        offload_optimizer="cpu",
        pin_memory=True,
        grad_ckpt=True,
        micro_batch=4,
        grad_accum=4,
        ref="precomputed",
        loss_impl="chunked",
    )
    assert fallback.dynamics_problems(base, same, WORLD) == []
    assert fallback.dynamics_problems(base, cand(micro_batch=8), WORLD) == [
        "global batch 32 -> 16 (micro_batch x grad_accum x 2 ranks) changes the data order"
    ]
    refused = {
        "precision": cand(precision="bf16"),
        "seq_len": cand(seq_len=64),
        "finetune": cand(finetune="lora"),
        "attn": cand(attn="eager"),
    }
    for key, c in refused.items():
        problems = fallback.dynamics_problems(base, c, WORLD)
        assert len(problems) == 1 and problems[0].startswith(f"{key} ") and "changes what is learned" in problems[0], (
            problems
        )


def test_next_candidate_is_the_first_fitting_one_that_keeps_dynamics_and_can_continue_the_checkpoint():
    selected = cand()
    ranking = [
        row(selected, device_bytes=90),
        row(cand(precision="bf16"), device_bytes=50),  # faster, but trains something else
        row(cand(zero=2, micro_batch=8, grad_accum=2), device_bytes=60),  # no ZeRO-0 -> ZeRO-2 conversion
        row(cand(micro_batch=8, grad_accum=2, loss_impl="chunked"), device_bytes=95),  # needs more than what ran out
        row(cand(micro_batch=8, grad_accum=4), device_bytes=40),  # global batch 64
        row(cand(micro_batch=4, grad_accum=4), fits=False, device_bytes=20),  # does not fit: skipped silently
        row(cand(micro_batch=4, grad_accum=4, grad_ckpt=True), device_bytes=70),  # the one
        row(cand(micro_batch=2, grad_accum=8), device_bytes=30),
    ]
    nxt, refused = fallback.next_candidate(ranking, selected, selected, selected, [ranking[0]["id"]], WORLD)
    assert nxt is ranking[6]
    assert [r.split(":")[0] for r in refused] == [ranking[i]["id"] for i in (1, 2, 3, 4)]
    assert "precision 'fp32' -> 'bf16' changes what is learned" in refused[0]
    assert "written with ZeRO-0 and cannot continue under ZeRO-2" in refused[1]
    assert "not less than the 90 B of" in refused[2]
    assert "global batch 32 -> 64" in refused[3]
    # that one ran out too: next in line, judged against the candidate that failed last
    tried = [ranking[0]["id"], ranking[6]["id"]]
    nxt, _ = fallback.next_candidate(ranking, selected, ranking[6]["candidate"], selected, tried, WORLD)
    assert nxt is ranking[7]
    tried.append(ranking[7]["id"])
    nxt, refused = fallback.next_candidate(ranking, selected, ranking[7]["candidate"], selected, tried, WORLD)
    assert nxt is None and len(refused) == 4


def test_without_a_checkpoint_any_zero_stage_may_take_over():
    selected = cand()
    z2 = row(cand(zero=2), device_bytes=60)
    nxt, refused = fallback.next_candidate([row(selected, device_bytes=90), z2], selected, selected, None, [], WORLD)
    assert nxt is z2 and refused == []


# --------------------------------------------------------------------------- which checkpoint a fallback continues
def meta(**c):
    return {"world_size": WORLD, "step": 3, "run_config": {"seed": 0, "candidate": cand(**c)}}


def now(fallback_n=1, **c):
    return {"seed": 0, "candidate": cand(**c), "fallback": fallback_n}


def test_a_fallback_resumes_across_levers_and_only_its_config_may():
    where = Path("ck/step00000003")
    # same optimizer layout: as saved
    assert (
        checkpoint.check_compatible(meta(), now(micro_batch=8, grad_accum=2, grad_ckpt=True), where, WORLD)
        == checkpoint.SAME
    )
    assert (
        checkpoint.check_compatible(meta(zero=2), now(zero=2, loss_impl="chunked", ref="precomputed"), where, WORLD)
        == checkpoint.SAME
    )
    # another ZeRO stage or offload: through DeepSpeed's universal checkpoint
    assert (
        checkpoint.check_compatible(meta(zero=2), now(zero=3, micro_batch=8, grad_accum=2), where, WORLD)
        == checkpoint.UNIVERSAL_LOAD
    )
    assert (
        checkpoint.check_compatible(meta(zero=2), now(zero=2, offload_optimizer="cpu"), where, WORLD)
        == checkpoint.UNIVERSAL_LOAD
    )
    with pytest.raises(ValueError, match=r"written with ZeRO-0 and cannot continue under ZeRO-2"):
        checkpoint.check_compatible(meta(), now(zero=2), where, WORLD)
    with pytest.raises(
        ValueError,
        match=r"written with ZeRO-3 and cannot continue under ZeRO-2: .* keeps no per-parameter Adam step",
    ):
        checkpoint.check_compatible(meta(zero=3), now(zero=2), where, WORLD)
    assert (
        checkpoint.check_compatible(meta(zero=3), now(zero=3, offload_optimizer="cpu"), where, WORLD)
        == checkpoint.UNIVERSAL_LOAD
    )
    with pytest.raises(ValueError, match=r"written with ZeRO-3 and cannot continue under ZeRO-0"):
        checkpoint.check_compatible(meta(zero=3), now(zero=0), where, WORLD)
    with pytest.raises(ValueError, match=r"ZeRO-3 partial optimizer offload \(offload_ratio 0.5\)"):
        checkpoint.check_compatible(meta(zero=2), now(zero=3, offload_optimizer="cpu", offload_ratio=0.5), where, WORLD)
    # the global batch and everything that is not a lever still must match
    with pytest.raises(ValueError, match=r"global batch: checkpoint 32 .* != now 16"):
        checkpoint.check_compatible(meta(), now(micro_batch=8), where, WORLD)
    with pytest.raises(ValueError, match=r"candidate.precision: checkpoint 'fp32' != now 'bf16'"):
        checkpoint.check_compatible(meta(), now(precision="bf16"), where, WORLD)
    # run.json itself (no fallback) resumes only its own candidate
    with pytest.raises(ValueError, match=r"candidate.micro_batch: checkpoint 16 != now 8"):
        checkpoint.check_compatible(meta(), now(0, micro_batch=8, grad_accum=2), where, WORLD)


# --------------------------------------------------------------------------- an OOM during a checkpoint save
class TrackedWriter:
    """Writes the checkpoint's shard as DeepSpeed does (torch.save of the state), making a copy of
    the weights first: under a tight AllocationTracker capacity that copy raises a real OOM."""

    def __init__(self, weights):
        self.weights = weights

    def save_checkpoint(self, root, tag, client_state, save_latest):
        d = Path(root) / tag
        d.mkdir(parents=True, exist_ok=True)
        (d / "mp_rank_00_model_states.pt").write_bytes(b"\0" * 100)  # a first file lands, then the copy
        state = {"module": self.weights.clone(), **client_state}
        torch.save(state, d / "mp_rank_00_model_states.pt")


def test_an_oom_during_a_save_leaves_the_previous_checkpoint_the_newest(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    root = tmp_path / "checkpoints"
    weights = torch.zeros(50_000)
    writer = TrackedWriter(weights)
    checkpoint.save(writer, root, 3, {"step": 3}, keep_last=2, run_config={})
    with AllocationTracker(capacity_bytes=None) as probe:
        pass
    capacity = probe.baseline_bytes + weights.nbytes // 2  # no room for the copy
    with pytest.raises(torch.OutOfMemoryError), AllocationTracker(capacity_bytes=capacity) as t:
        t.phase = "checkpoint save"
        checkpoint.save(writer, root, 6, {"step": 6}, keep_last=2, run_config={})
    assert t.oom["phase"] == "checkpoint save"
    assert (root / "step00000006").exists() and not (root / "step00000006" / checkpoint.COMPLETE).exists()
    assert (root / "latest").read_text() == "step00000003"
    assert checkpoint.complete_tags(root) == ["step00000003"]
    assert checkpoint.latest_valid(root, log=lambda _m: None) == (root, "step00000003")
    assert checkpoint.remove_incomplete(root, log=lambda _m: None) == ["step00000006"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step00000003"]


# --------------------------------------------------------------------------- state kept in the train directory
def test_fallback_state_belongs_to_one_run_json(tmp_path):
    out = tmp_path / "train"
    out.mkdir()
    base = RunConfig(method="sft", model_path="m", data_dir="d", out_dir=str(out), candidate=cand())
    base.save(tmp_path / "run.json")
    assert fallback.effective_run_json(tmp_path / "run.json") == tmp_path / "run.json"
    nxt = dataclasses.replace(base, candidate=cand(micro_batch=8, grad_accum=2), fallback=1)
    nxt.save(fallback.fallback_config_path(out, 1))
    rec = fallback.record(
        {
            "step": 5,
            "phase": "forward",
            "op": "aten.mm.default",
            "live_bytes": 11,
            "capacity_bytes": 10,
        },
        3,
        Candidate.from_dict(base.candidate).id,
        nxt.cand.id,
    )
    fallback.save_state(base, [rec])
    assert rec == {
        "oom_step": 5,
        "resumed_from_step": 3,
        "from": base.cand.id,
        "to": nxt.cand.id,
        "phase": "forward",
        "op": "aten.mm.default",
        "bytes_live": 11,
        "capacity_bytes": 10,
    }
    assert fallback.load_state(base) == [rec]
    assert fallback.effective_run_json(tmp_path / "run.json") == out / "run.fallback-1.json"
    assert RunConfig.load(out / "run.fallback-1.json").fallback == 1
    # select_config chose again (run.json changed): the old fallbacks are stale and go
    changed = dataclasses.replace(base, lr=base.lr * 2)
    changed.save(tmp_path / "run.json")
    assert fallback.effective_run_json(tmp_path / "run.json") == tmp_path / "run.json"
    assert not (out / "fallbacks.json").exists() and not (out / "run.fallback-1.json").exists()


def test_the_ranking_comes_from_selected_json_and_its_absence_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"selected.json: missing; the OOM fallback needs"):
        fallback.load_ranking(tmp_path / "selected.json")
    sel = {
        "model": "m",
        "gpu": "cpu",
        "method": "sft",
        "budget": {"device_bytes": 100, "host_bytes": 1000, "headroom": 0.1},
        "plan_only": False,
        "launch": "memfit launch",
        "selected": {
            "id": "a",
            "candidate": cand(),
            "predicted": {},
            "source": "measured",
            "fits": True,
            "reason": "",
            "device_bytes": 80,
            "host_bytes": 5,
            "step_time_s": 1.0,
            "tokens_per_s": 10.0,
        },
    }
    sel["candidates"] = [
        sel["selected"],
        {**sel["selected"], "id": "b", "fits": False, "reason": "does not fit"},
    ]
    (tmp_path / "selected.json").write_text(json.dumps(sel))
    ranking = fallback.load_ranking(tmp_path / "selected.json")
    assert [(r["id"], r["fits"], r["device_bytes"]) for r in ranking] == [
        ("a", True, 80),
        ("b", False, 80),
    ]


# --------------------------------------------------------------------------- the loop in pipeline.train
class ShardWriter:
    def save_checkpoint(self, root, tag, client_state, save_latest):
        d = Path(root) / tag
        d.mkdir(parents=True, exist_ok=True)
        torch.save({"module": torch.zeros(10), **client_state}, d / "mp_rank_00_model_states.pt")


def selected_json(path, rows):
    sel = {
        "model": "m",
        "gpu": "cpu",
        "method": "sft",
        "budget": {"device_bytes": 100, "host_bytes": 1000, "headroom": 0.0},
        "plan_only": False,
        "launch": "memfit launch",
        "selected": rows[0],
        "candidates": rows,
    }
    for r in rows:
        r.update(predicted={}, reason="", source="predicted")
        r.pop("device_bytes", None)
    path.write_text(json.dumps(sel))


def start_dirs(tmp_path):
    """A model and a prepared data directory as the train stage checks and hashes them (memfit.train.identity)."""
    model, data = tmp_path / "m", tmp_path / "d"
    model.mkdir()
    data.mkdir()
    (model / "config.json").write_text("{}")
    (data / "train.parquet").write_bytes(b"rows")
    return str(model), str(data)


def ranks_that(monkeypatch, behaviour):
    """Replace the launcher: `behaviour[candidate id](run, out_dir)` does what the ranks would and
    returns the exit code; the calls are recorded as (run config file name, candidate id)."""
    import memfit.train.launch

    calls = []

    def fake_launch(config, nproc, log=None, timeout_s=None, nnodes=1):
        run = RunConfig.load(config)
        calls.append((Path(config).name, run.cand.id))
        return behaviour[run.cand.id](run, Path(run.out_dir))

    monkeypatch.setattr(memfit.train.launch, "launch", fake_launch)
    return calls


def test_pipeline_train_falls_back_records_it_and_continues_a_crashed_fallback(tmp_path, monkeypatch, capfd):
    from memfit.workflow import pipeline

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    job = tmp_path / "sft"
    out = job / "train"
    first = cand(zero=2, micro_batch=8, grad_accum=1)
    other = cand(zero=2, micro_batch=8, grad_accum=1, precision="bf16")
    second = cand(zero=2, micro_batch=4, grad_accum=2)
    model, data = start_dirs(tmp_path)
    base = RunConfig(method="sft", model_path=model, data_dir=data, out_dir=str(out), candidate=first)
    job.mkdir()
    base.save(job / "run.json")
    selected_json(job / "selected.json", [row(first), row(other), row(second)])

    def runs_out_at_step_6(run, out):  # checkpoint 3 published, the save of step 6 cut short by an OOM
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": s, "split": "train", "loss": 1.0}) + "\n" for s in range(1, 4))
        )
        checkpoint.save(
            ShardWriter(),
            out / "checkpoints",
            3,
            {"step": 3},
            keep_last=2,
            run_config=dataclasses.asdict(run),
            metrics=out / "metrics.jsonl",
        )
        (out / "checkpoints/step00000006").mkdir()
        (out / "oom.rank0.json").write_text(
            json.dumps(
                {
                    "rank": 0,
                    "step": 6,
                    "phase": "checkpoint save",
                    "op": "aten.clone.default",
                    "live_bytes": 101,
                    "capacity_bytes": 100,
                }
            )
        )
        return 1

    def crashes(run, out):
        return 1

    calls = ranks_that(
        monkeypatch,
        {
            Candidate.from_dict(first).id: runs_out_at_step_6,
            Candidate.from_dict(second).id: crashes,
        },
    )
    with pytest.raises(RuntimeError, match=r"training failed \(exit code 1\)"):
        pipeline.train(job / "run.json", 1, job / "train.log")
    ids = [Candidate.from_dict(c).id for c in (first, other, second)]
    # the ranks read a copy of run.json with the content digests (run.json, select_config's output, stays)
    assert calls == [("run.resolved.json", ids[0]), ("run.fallback-1.json", ids[2])]
    line = f"memfit: OOM fallback 1: {ids[0]} ran out of device memory at step 6 (checkpoint save, 101 B live > 100 B); continuing with {ids[2]} from step 3"
    assert line in capfd.readouterr().err and line in (job / "train.log").read_text()
    assert not (out / "checkpoints/step00000006").exists()  # the half-written save is gone
    nxt = RunConfig.load(out / "run.fallback-1.json")
    assert (
        nxt.candidate == second
        and nxt.fallback == 1
        and dataclasses.replace(nxt, candidate=first, fallback=0, inputs={}) == base
    )

    # the job is re-run (crash, preemption): it continues with the fallback, not with run.json
    def finishes(run, out):
        (out / "summary.json").write_text(json.dumps({"steps": 5}))
        return 0

    calls = ranks_that(monkeypatch, {ids[2]: finishes})
    summary = pipeline.train(job / "run.json", 1, job / "train.log")
    assert calls == [("run.fallback-1.json", ids[2])]
    assert summary == json.loads((out / "summary.json").read_text())
    assert summary["trained_candidate"] == ids[2]
    assert summary["fallbacks"] == [
        {
            "oom_step": 6,
            "resumed_from_step": 3,
            "from": ids[0],
            "to": ids[2],
            "phase": "checkpoint save",
            "op": "aten.clone.default",
            "bytes_live": 101,
            "capacity_bytes": 100,
        }
    ]
    assert fallback.effective_run_json(job / "run.json") == out / "run.fallback-1.json"

    # the fallback runs out too: no candidate left, named with what was tried and why the rest was refused
    def oom_again(run, out):
        (out / "oom.rank0.json").write_text(json.dumps({"rank": 0, "step": 7, "phase": "forward"}))
        return 1

    ranks_that(monkeypatch, {ids[2]: oom_again})
    with pytest.raises(RuntimeError) as e:
        pipeline.train(job / "run.json", 1, job / "train.log")
    msg = str(e.value)
    assert f"ran out of device memory with {ids[2]} at step 7 (forward), and no candidate is left" in msg
    assert f"Tried: {ids[0]}, {ids[2]}." in msg
    assert f"{ids[1]}: precision 'fp32' -> 'bf16' changes what is learned" in msg


def test_without_an_oom_marker_a_failed_training_is_not_a_fallback(tmp_path, monkeypatch):
    from memfit.workflow import pipeline

    job = tmp_path / "sft"
    model, data = start_dirs(tmp_path)
    base = RunConfig(
        method="sft",
        model_path=model,
        data_dir=data,
        out_dir=str(job / "train"),
        candidate=cand(zero=2),
    )
    job.mkdir()
    base.save(job / "run.json")
    calls = ranks_that(monkeypatch, {base.cand.id: lambda run, out: -9})  # e.g. the kernel's SIGKILL (host OOM)
    with pytest.raises(RuntimeError, match=r"training failed \(exit code -9\)"):
        pipeline.train(job / "run.json", 1, job / "train.log")
    assert len(calls) == 1 and not (job / "train/fallbacks.json").exists()


def test_a_zero2_universal_checkpoint_is_made_loadable_by_zero3(tmp_path, monkeypatch):
    """What ds_to_universal writes for a ZeRO-1/2 checkpoint (top-level param_groups, a step per
    parameter, mp_rank_00_model_states.pt) gets what ZeRO-3's universal loader reads."""
    monkeypatch.setenv("RANK", "0")
    conv = tmp_path / "checkpoints/universal/step00000003"
    (conv / "zero/a.weight").mkdir(parents=True)
    (conv / "zero/b.weight").mkdir()
    groups = [{"lr": 0.002, "betas": [0.9, 0.95], "step": 0, "params": [0]}]
    torch.save(
        {"ds_version": "0.19.8", "clip_grad": 1.0, "param_groups": groups},
        conv / "zero/optimizer_state.pt",
    )
    for name in ("a.weight", "b.weight"):
        torch.save(3, conv / "zero" / name / "step.pt")
    torch.save({"global_steps": 3}, conv / "mp_rank_00_model_states.pt")
    src = tmp_path / "checkpoints/step00000003"  # a source and the manifest ensure_universal writes
    src.mkdir()
    (src / "memfit.json").write_text("{}")
    checkpoint.record_conversion(conv, src)
    checkpoint.universal_for_stage(tmp_path / "checkpoints", "step00000003", 3)
    sd = torch.load(conv / "zero/optimizer_state.pt", weights_only=False)
    assert sd["optimizer_state_dict"] == {
        "state": {0: {"step": 3}},
        "param_groups": [{"lr": 0.002, "betas": [0.9, 0.95], "step": 0}],
    }
    assert sd["param_groups"] == groups and sd["clip_grad"] == 1.0
    assert torch.load(conv / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False) == {"global_steps": 3}
    assert sorted(p.name for p in conv.rglob(".*")) == []  # no temporary left
    torch.save(4, conv / "zero/b.weight/step.pt")  # parameters disagree: refused, not guessed
    torch.save({"ds_version": "0.19.8", "param_groups": groups}, conv / "zero/optimizer_state.pt")
    checkpoint.record_conversion(conv, src)
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"expected one Adam step over all parameters, found \[3, 4\]",
    ):
        checkpoint.universal_for_stage(tmp_path / "checkpoints", "step00000003", 3)
