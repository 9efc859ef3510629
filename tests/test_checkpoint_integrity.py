"""What is checked before a checkpoint loads (memfit.train.checkpoint_digest): every file's SHA-256
against memfit.json's manifest, memfit.json's own SHA-256 against COMPLETE, the step against the
directory, the run's end and what DeepSpeed restores; and no pickle from a run folder runs. The
fast tests use a stand-in engine that writes DeepSpeed's file layout; the slow ones resume real
DeepSpeed runs (2 CPU ranks) from a damaged or crafted run folder, as a user meets it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from memfit.train import checkpoint, checkpoint_digest

SHARD = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


class FakeEngine:
    """Writes DeepSpeed's file layout on save; on load reads the model states as DeepSpeed's loader
    does (torch.load with weights_only=False) and restores `global_steps` from them."""

    optimizer = None  # nothing for memfit.train.adam_steps to replay

    def __init__(self):
        self.global_steps = 0

    def save_checkpoint(self, root, tag, client_state, save_latest):
        d = Path(root) / tag
        d.mkdir(parents=True, exist_ok=True)
        torch.save(
            {"w": torch.arange(4000.0), "global_steps": client_state["step"], **client_state},
            d / "mp_rank_00_model_states.pt",
        )
        torch.save({"m": torch.randn(3000, generator=torch.Generator().manual_seed(1))}, d / SHARD)

    def load_checkpoint(self, root, tag, **_kw):
        sd = torch.load(Path(root) / tag / "mp_rank_00_model_states.pt", weights_only=False)
        self.global_steps = sd["global_steps"]
        return root, {"step": sd["step"]}


def save(root: Path, step: int) -> Path:
    return checkpoint.save(FakeEngine(), root, step, {"step": step}, keep_last=3, run_config={"seed": 0})


def flip_4k(path: Path) -> None:
    """Invert 4 KiB in the middle of `path`: same size, same name, other bytes."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 4096] = bytes(b ^ 0xFF for b in data[mid : mid + 4096])
    path.write_bytes(bytes(data))


def republish(ckpt: Path) -> None:
    """What someone who rewrites a checkpoint on purpose does: a new manifest and COMPLETE that match."""
    meta = json.loads((ckpt / "memfit.json").read_text())
    names = sorted(meta["files"])
    meta["files"] = checkpoint_digest.file_entries(ckpt, names)
    (ckpt / "memfit.json").write_text(json.dumps(meta))
    (ckpt / "COMPLETE").write_text(
        checkpoint_digest.complete_text(ckpt.name, checkpoint_digest.sha256_file(ckpt / "memfit.json"))
    )


class Payload:
    """A pickle that writes a file when it is unpickled (what a crafted checkpoint file would run)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_the_manifest_records_every_files_sha256_and_complete_records_the_manifests(tmp_path):
    ckpt = save(tmp_path, 10)
    meta = json.loads((ckpt / "memfit.json").read_text())
    on_disk = sorted(p.name for p in ckpt.iterdir() if p.name not in ("memfit.json", "COMPLETE"))
    assert sorted(meta["files"]) == on_disk == ["mp_rank_00_model_states.pt", "rng.rank0.pt", SHARD]
    for name, entry in meta["files"].items():
        raw = (ckpt / name).read_bytes()
        assert entry == {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    manifest_sha = hashlib.sha256((ckpt / "memfit.json").read_bytes()).hexdigest()
    assert (ckpt / "COMPLETE").read_text() == f"step00000010\nmemfit.json sha256 {manifest_sha}\n"


def test_a_flipped_4k_block_in_a_shard_is_named_and_the_previous_checkpoint_taken(tmp_path):
    save(tmp_path, 10)
    save(tmp_path, 20)
    flip_4k(tmp_path / "step00000020" / SHARD)
    said = []
    assert checkpoint.latest_valid(tmp_path, log=said.append, digests=True) == (tmp_path, "step00000010")
    assert len(said) == 1
    assert said[0].startswith(
        f"warning: checkpoint {tmp_path / 'step00000020'} is incomplete or corrupt; falling back to"
    )
    assert f"{tmp_path / 'step00000020' / SHARD}: its SHA-256 differs from the manifest's" in said[0]
    # and a load named explicitly (resume: <path>) refuses it before DeepSpeed reads a byte
    engine = FakeEngine()
    with pytest.raises(checkpoint.CheckpointError, match=rf"{SHARD}: its SHA-256 differs.*Nothing was loaded"):
        checkpoint.load(engine, tmp_path, "step00000020", run_config={"seed": 0})
    assert engine.global_steps == 0


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        ("step 600", r"memfit.json was changed after the checkpoint was published"),
        ("step 600, republished", r"memfit.json: step 600 does not match the checkpoint's directory step00000020"),
        ("no files", r"memfit.json was changed after the checkpoint was published"),
        ("no files, republished", r"memfit.json has no `files` manifest"),
        ("garbled", r"memfit.json was changed after the checkpoint was published"),
        ("garbled, republished", r"memfit.json is not valid JSON"),
        (
            "old COMPLETE",
            r"COMPLETE records no SHA-256 of memfit.json: a checkpoint written before memfit checked digests",
        ),
        ("rng.rank0.pt truncated", r"rng.rank0.pt is \d+ bytes, the manifest says \d+ \(truncated or overwritten\)"),
        ("shard truncated, its manifest size too", r"memfit.json was changed after the checkpoint was published"),
    ],
)
def test_an_edited_or_broken_manifest_falls_back_naming_the_file(tmp_path, edit, reason):
    """Every re-run falls back to the previous checkpoint (never broken for good); cheap checks
    (the workflow's choice) and full digests (a resume) agree."""
    save(tmp_path, 10)
    ckpt = save(tmp_path, 20)
    manifest = ckpt / "memfit.json"
    meta = json.loads(manifest.read_text())
    if edit.startswith("step 600"):
        manifest.write_text(json.dumps({**meta, "step": 600}))
    elif edit.startswith("no files"):
        manifest.write_text(json.dumps({k: v for k, v in meta.items() if k != "files"}))
    elif edit.startswith("garbled"):
        manifest.write_bytes(manifest.read_bytes()[:40] + b"\x00\xff garbled")
    elif edit == "old COMPLETE":
        (ckpt / "COMPLETE").write_text("step00000020\n")  # what memfit wrote before digests
    elif edit.startswith("rng"):
        (ckpt / "rng.rank0.pt").write_bytes((ckpt / "rng.rank0.pt").read_bytes()[:100])
    else:  # a torn shard whose size someone wrote into the manifest
        (ckpt / SHARD).write_bytes((ckpt / SHARD).read_bytes()[:100])
        meta["files"][SHARD]["size"] = 100
        manifest.write_text(json.dumps(meta))
    if edit.endswith("republished"):
        (ckpt / "COMPLETE").write_text(
            checkpoint_digest.complete_text(ckpt.name, checkpoint_digest.sha256_file(manifest))
        )
    for digests in (False, True):
        said = []
        assert checkpoint.latest_valid(tmp_path, log=said.append, digests=digests) == (tmp_path, "step00000010")
        assert len(said) == 1 and "step00000020 is incomplete or corrupt; falling back to" in said[0], said
        assert f"{ckpt}" in said[0] and re.search(reason, said[0]), said[0]


def test_a_checkpoint_beyond_the_runs_end_is_not_this_runs(tmp_path):
    save(tmp_path, 6)
    save(tmp_path, 600)
    said = []
    assert checkpoint.latest_valid(tmp_path, log=said.append, digests=True, max_step=8) == (tmp_path, "step00000006")
    assert "step00000600/memfit.json: step 600 is beyond the run's end (8 steps)" in said[0]


def test_only_checkpoints_written_before_digests_start_fresh_with_a_warning(tmp_path):
    ckpt = save(tmp_path, 10)
    (ckpt / "COMPLETE").write_text("step00000010\n")
    said = []
    assert checkpoint.latest_valid(tmp_path, log=said.append, digests=True) is None
    assert "written before memfit checked digests" in said[0]
    assert said[-1].startswith(
        f"warning: no valid checkpoint under {tmp_path} ('latest' names step00000010); starting fresh"
    )
    # the fresh run's next save removes the old timeline's later checkpoints
    save(tmp_path, 3)
    assert checkpoint.complete_tags(tmp_path) == ["step00000003"]


def test_the_step_deepspeed_restores_must_be_the_manifests(tmp_path):
    ckpt = save(tmp_path, 20)
    sd = torch.load(ckpt / "mp_rank_00_model_states.pt", weights_only=True)
    torch.save({**sd, "global_steps": 600}, ckpt / "mp_rank_00_model_states.pt")
    republish(ckpt)  # the digests all match: only DeepSpeed's own state tells
    with pytest.raises(checkpoint.CheckpointError, match=r"memfit.json says step 20, DeepSpeed restored step 600"):
        checkpoint.load(FakeEngine(), tmp_path, "step00000020", run_config={"seed": 0})


def test_an_unchanged_file_is_hashed_once_and_a_changed_one_again(tmp_path, monkeypatch):
    ckpt = save(tmp_path, 20)
    hashed = []
    real = checkpoint_digest.sha256_file
    monkeypatch.setattr(checkpoint_digest, "sha256_file", lambda p: hashed.append(Path(p).name) or real(p))
    assert checkpoint.latest_valid(tmp_path, log=print, digests=True) == (tmp_path, "step00000020")
    assert sorted(hashed) == sorted(json.loads((ckpt / "memfit.json").read_text())["files"])
    hashed.clear()
    assert checkpoint_digest.verify(ckpt)[1] is None  # the load's own check, right before reading
    assert hashed == []
    flip_4k(ckpt / SHARD)  # changed after the choice: same size, but its ctime moved
    assert f"{SHARD}: its SHA-256 differs" in checkpoint_digest.verify(ckpt)[1]
    assert hashed == [SHARD]


def test_a_crafted_rng_state_does_not_run(tmp_path):
    """rng.rank0.pt replaced by a pickle that would write a file: with the manifest as memfit wrote
    it, the digest names it and the previous checkpoint is taken; with a manifest rewritten to
    match, the load refuses it (weights_only) and nothing of it runs."""
    marker = tmp_path / "pwned"
    save(tmp_path, 10)
    ckpt = save(tmp_path, 20)
    torch.save({"python": Payload(marker)}, ckpt / "rng.rank0.pt")
    said = []
    assert checkpoint.latest_valid(tmp_path, log=said.append, digests=True) == (tmp_path, "step00000010")
    assert f"{ckpt / 'rng.rank0.pt'} is " in said[0]  # another size than memfit wrote
    republish(ckpt)
    assert checkpoint.latest_valid(tmp_path, log=said.append, digests=True) == (tmp_path, "step00000020")
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"rng.rank0.pt holds more than tensors and numbers .*refused without running it",
    ):
        checkpoint.load(FakeEngine(), tmp_path, "step00000020", run_config={"seed": 0})
    assert not marker.exists()


def test_a_crafted_shard_with_a_matching_manifest_does_not_run(tmp_path):
    """DeepSpeed's loader asks torch.load for weights_only=False; while memfit loads, it gets
    weights_only=True with DeepSpeed's own classes allowed, and nothing else."""
    marker = tmp_path / "pwned"
    ckpt = save(tmp_path, 20)
    torch.save(
        {"w": torch.zeros(3), "global_steps": 20, "step": 20, "x": Payload(marker)}, ckpt / "mp_rank_00_model_states.pt"
    )
    republish(ckpt)
    with pytest.raises(
        checkpoint.CheckpointError, match=r"mp_rank_00_model_states.pt holds more than tensors .*GLOBAL posix.system"
    ):
        checkpoint.load(FakeEngine(), tmp_path, "step00000020", run_config={"seed": 0})
    assert not marker.exists()


def test_the_offline_check_names_each_checkpoints_verdict_and_cost(tmp_path, capsys):
    save(tmp_path, 10)
    save(tmp_path, 20)
    assert checkpoint_digest.main([str(tmp_path / "step00000010"), str(tmp_path / "step00000020")]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"step00000010: sound, 3 files, 0.000 GiB hashed in [\d.]+ s \([\d.]+ GiB/s, [\d.]+ s per GiB\)", out
    )
    flip_4k(tmp_path / "step00000020" / SHARD)
    assert checkpoint_digest.main([str(tmp_path / "step00000020")]) == 1
    assert (
        f"step00000020: NOT SOUND: {tmp_path / 'step00000020' / SHARD}: its SHA-256 differs" in capsys.readouterr().out
    )
    assert checkpoint_digest.main([str(tmp_path / "step00000099")]) == 2
    assert "not a checkpoint directory: " in capsys.readouterr().err


def test_honest_rng_states_round_trip_exactly(tmp_path):
    import random

    import numpy as np

    random.seed(5), np.random.seed(6), torch.manual_seed(7)
    random.gauss(0, 1), np.random.standard_normal()  # a cached gaussian in both
    torch.save(checkpoint.rng_state(), tmp_path / "rng.rank0.pt")
    want = (random.random(), random.gauss(0, 1), np.random.standard_normal(), np.random.rand(), torch.rand(3))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    checkpoint.load_rng_state(tmp_path / "rng.rank0.pt")
    got = (random.random(), random.gauss(0, 1), np.random.standard_normal(), np.random.rand(), torch.rand(3))
    assert got[:4] == want[:4] and torch.equal(got[4], want[4])


# --------------------------------------------------------------------------- real DeepSpeed runs
def _rerun_copy(shared_runs, tmp_path, damage) -> tuple[Path, Path, list[dict]]:
    """A copy of the session's finished ZeRO-2 run (checkpoints at 3 and 6), `damage(step6)`, re-run."""
    from deepspeed_runs import run

    src, _ = shared_runs["sft-z2"]
    out = tmp_path / "run"
    shutil.copytree(src, out)
    damage(out / "checkpoints/step00000006")
    cfg = dataclasses.replace(shared_runs.config("sft-z2"), out_dir=str(out))
    return src, out, run(cfg)


def _same_end(src: Path, out: Path, rows: list[dict]) -> None:
    ref = [json.loads(line) for line in (src / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["split"], r["loss"]) for r in rows] == [(r["step"], r["split"], r["loss"]) for r in ref]
    a, b = load_file(str(src / "model/model.safetensors")), load_file(str(out / "model/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_flipped_shard_resumes_from_the_previous_checkpoint_bit_exact(shared_runs, tmp_path):
    src, out, rows = _rerun_copy(shared_runs, tmp_path, lambda ck: flip_4k(ck / SHARD))
    log = (out / "log.txt").read_text()
    assert f"checkpoints/step00000006/{SHARD}: its SHA-256 differs from the manifest's" in log
    assert "resumed from" in log and "step00000003 at step 3" in log
    assert [r["step"] for r in rows if r.get("resumed_from_step") == 3] == [4]  # steps 4-6 trained again
    _same_end(src, out, rows)


@pytest.mark.slow
def test_a_manifest_step_edited_to_600_is_not_trusted_and_the_run_trains_its_steps(shared_runs, tmp_path):
    def edit(ck):
        meta = json.loads((ck / "memfit.json").read_text())
        (ck / "memfit.json").write_text(json.dumps({**meta, "step": 600}))

    src, out, rows = _rerun_copy(shared_runs, tmp_path, edit)
    log = (out / "log.txt").read_text()
    assert "step00000006/memfit.json was changed after the checkpoint was published" in log
    assert [r["step"] for r in rows if r["split"] == "train"][-3:] == [4, 5, 6]
    _same_end(src, out, rows)


@pytest.mark.slow
def test_a_crafted_deepspeed_shard_with_a_rewritten_manifest_does_not_run(shared_runs, tmp_path):
    """DeepSpeed's real loader (memfit's streamed load) meets a model-states file with a payload
    and a manifest rewritten to match: the run stops naming the file; the payload never ran."""
    marker = tmp_path / "pwned"

    def craft(ck):
        with checkpoint_digest.safe_loads():
            sd = torch.load(ck / "mp_rank_00_model_states.pt")
        torch.save({**sd, "extra": Payload(marker)}, ck / "mp_rank_00_model_states.pt")
        republish(ck)

    with pytest.raises(AssertionError) as failed:  # deepspeed_runs.run asserts the launch's exit code 0
        _rerun_copy(shared_runs, tmp_path, craft)
    assert "mp_rank_00_model_states.pt holds more than tensors and numbers" in str(failed.value)
    assert "refused without running it" in str(failed.value)
    assert not marker.exists()
