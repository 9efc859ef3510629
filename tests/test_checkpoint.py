"""Checkpoints are whole or ignored: truncation, a crash mid-save and a full disk (no DeepSpeed
needed: a stand-in engine writes shard files the way DeepSpeed lays them out)."""

import json
import shutil

import pytest
import torch

from memfit.train import checkpoint


class FakeEngine:
    """Writes `<root>/<tag>/mp_rank_00_model_states.pt` and an optimizer shard, like DeepSpeed."""

    def __init__(self, fail_after_first_file: bool = False):
        self.fail = fail_after_first_file

    def save_checkpoint(self, root, tag, client_state, save_latest):
        d = checkpoint.Path(root) / tag
        d.mkdir(parents=True, exist_ok=True)
        torch.save({"w": torch.arange(1000.0), **client_state}, d / "mp_rank_00_model_states.pt")
        if self.fail:
            raise OSError(28, "No space left on device")
        torch.save({"m": torch.zeros(3000)}, d / "zero_pp_rank_0_mp_rank_00_optim_states.pt")


def save(root, step, engine=None, **kw):
    return checkpoint.save(
        engine or FakeEngine(), root, step, {"step": step}, keep_last=3, run_config={"seed": 0}, **kw
    )


def test_latest_complete_checkpoint_is_found(tmp_path):
    save(tmp_path, 10)
    save(tmp_path, 20)
    assert checkpoint.latest_valid(tmp_path) == (tmp_path, "step00000020")


def test_truncated_newest_falls_back_to_previous_with_a_warning(tmp_path):
    save(tmp_path, 10)
    save(tmp_path, 20)
    shard = tmp_path / "step00000020" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:100])  # a torn write
    said = []
    assert checkpoint.latest_valid(tmp_path, log=said.append) == (tmp_path, "step00000010")
    assert said and "step00000020 is incomplete or corrupt; falling back to" in said[0]


def test_crash_mid_save_leaves_the_previous_checkpoint_in_charge(tmp_path):
    save(tmp_path, 10)
    with pytest.raises(OSError):
        save(tmp_path, 20, engine=FakeEngine(fail_after_first_file=True))
    assert (tmp_path / "latest").read_text() == "step00000010"
    assert not (tmp_path / "step00000020" / checkpoint.COMPLETE).exists()
    assert checkpoint.latest_valid(tmp_path) == (tmp_path, "step00000010")


def test_full_disk_is_refused_before_writing_and_the_previous_stays(tmp_path, monkeypatch):
    save(tmp_path, 10)
    size = checkpoint.dir_bytes(tmp_path / "step00000010")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda _p: usage._replace(free=size // 2))
    with pytest.raises(
        checkpoint.CheckpointError, match=r"not enough disk .*GiB needed.*GiB free.*previous checkpoint is intact"
    ):
        save(tmp_path, 20)
    assert not (tmp_path / "step00000020").exists()
    assert checkpoint.latest_valid(tmp_path) == (tmp_path, "step00000010")


def test_rotation_keeps_the_last_k(tmp_path):
    for step in (1, 2, 3, 4, 5):
        save(tmp_path, step)
    assert checkpoint.complete_tags(tmp_path) == ["step00000003", "step00000004", "step00000005"]


def test_a_checkpoint_of_another_run_is_refused_naming_the_difference(tmp_path):
    import json

    save(tmp_path, 10)
    meta = json.loads((tmp_path / "step00000010" / "memfit.json").read_text())
    with pytest.raises(ValueError, match=r"belongs to a different run(.|\n)*seed: checkpoint 0 != now 1"):
        checkpoint.check_compatible(meta, {"seed": 1}, tmp_path / "step00000010", world=1)


def test_a_preference_method_resumes_only_with_its_hyperparameters(tmp_path):
    """A SimPO run relaunched with another gamma is another run; a checkpoint written before
    RunConfig.pref existed (none recorded) continues a run without hyperparameters."""
    import json

    save(tmp_path, 10)
    where = tmp_path / "step00000010"
    meta = json.loads((where / "memfit.json").read_text())
    then = meta["run_config"]
    meta["run_config"] = then | {"pref": {"simpo_gamma": 0.5}}
    with pytest.raises(ValueError, match=r"pref: checkpoint \{'simpo_gamma': 0.5\} != now \{'simpo_gamma': 1.0\}"):
        checkpoint.check_compatible(meta, then | {"pref": {"simpo_gamma": 1.0}}, where, world=1)
    assert checkpoint.check_compatible(meta, then | {"pref": {"simpo_gamma": 0.5}}, where, world=1)
    meta["run_config"] = {k: v for k, v in then.items() if k != "pref"}
    assert checkpoint.check_compatible(meta, then | {"pref": {}}, where, world=1)


def test_metrics_travel_with_the_checkpoint_and_a_torn_line_is_dropped(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "split": "train", "loss": 2.0}\n{"step": 2, "split": "train", "loss": 1.5}\n')
    checkpoint.save(FakeEngine(), tmp_path / "ck", 2, {"step": 2}, keep_last=2, run_config={}, metrics=metrics)
    # the run went on, then was killed mid-write
    metrics.write_text(metrics.read_text() + '{"step": 3, "split": "train", "loss": 1.2}\n{"step": 4, "spl')
    checkpoint.restore_metrics(metrics, 2, tmp_path / "ck" / "step00000002")
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]
    (tmp_path / "ck" / "step00000002" / "metrics.jsonl").unlink()  # an older checkpoint without a copy
    metrics.write_text(metrics.read_text() + '{"step": 3, "split": "train", "loss": 1.2}\n{"step": 4, "spl')
    checkpoint.restore_metrics(metrics, 2, tmp_path / "ck" / "step00000002")
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]
