"""Runs identified by content (memfit.train.identity, issue #41): digests of the model and data a
run starts from, cached by file identity; a checkpoint of other content is set aside with the
reason; `memfit launch` refuses bad paths and an unknown method before any rank, and prints a
refusal the ranks raise once. The DPO-after-a-retrained-SFT run is in test_identity_dpo.py."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest

from memfit import cli
from memfit.train import identity
from memfit.train import launch as launch_mod
from memfit.train.checkpoint_compat import check_compatible
from memfit.train.run_config import RunConfig, RunRefused


@pytest.fixture(autouse=True)
def digest_cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache" / "sha256.json"
    monkeypatch.setenv(identity.CACHE_ENV, str(path))
    return path


def start_dirs(root: Path) -> tuple[Path, Path]:
    model, data = root / "model", root / "data"
    model.mkdir(parents=True)
    data.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(b"\x01" * 4096)
    (model / "tokenizer.json").write_text("{}")
    (model / "README.md").write_text("not part of the model")
    (data / "train.parquet").write_bytes(b"rows")
    (data / "eval.parquet").write_bytes(b"held out")
    (data / "stats.json").write_text("{}")
    return model, data


def run_config(root: Path, method="dpo", **kw) -> RunConfig:
    model, data = root / "model", root / "data"
    return RunConfig(
        method=method,
        model_path=str(model),
        data_dir=str(data),
        out_dir=str(root / "out"),
        candidate={"zero": 0},
        ref_model_path=str(model) if method == "dpo" else None,
        **kw,
    )


def rewrite_same_size_and_mtime(path: Path, data: bytes) -> None:
    """New content, same size, the old mtime put back (what `cp -p` or a careless tool leaves)."""
    st = path.stat()
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_model_is_hashed_once_and_a_change_of_content_is_seen(tmp_path, digest_cache, monkeypatch):
    start_dirs(tmp_path)
    cfg = run_config(tmp_path)
    first = identity.run_inputs(cfg)
    assert set(first) == {"model", "ref", "data"} and first["ref"] == first["model"]  # the reference is the policy
    hashed = []
    real = identity.sha256_file
    monkeypatch.setattr(identity, "sha256_file", lambda p: hashed.append(p.name) or real(p))
    assert identity.run_inputs(cfg) == first and hashed == []  # from the cache: no file read again
    # the README is not part of the model
    (tmp_path / "model/README.md").write_text("edited")
    assert identity.run_inputs(cfg) == first and hashed == []
    # new weights under the same path, size and mtime: the ctime (and the digest) change
    rewrite_same_size_and_mtime(tmp_path / "model/model.safetensors", b"\x02" * 4096)
    second = identity.run_inputs(cfg)
    assert hashed == ["model.safetensors"]
    assert second["model"] != first["model"] and second["ref"] == second["model"] and second["data"] == first["data"]
    # a corrupt cache is ignored: everything is hashed again, to the same digests
    digest_cache.write_text("{not json")
    hashed.clear()
    assert (
        identity.run_inputs(cfg) == second and len(hashed) == 6
    )  # 3 model files (the reference shares them), 3 data files
    assert json.loads(digest_cache.read_text())  # and written anew


def test_a_checkpoint_of_another_sft_model_belongs_to_another_run(tmp_path):
    then = {"model": "ab" * 32, "ref": "ab" * 32, "data": "cd" * 32}
    now = dict(then, model="ef" * 32, ref="ef" * 32)
    cfg = dataclasses.asdict(run_config(tmp_path)) | {"inputs": then}
    meta = {"world_size": 2, "run_config": cfg}
    assert check_compatible(meta, cfg, tmp_path / "step3", world=2) == "same"
    with pytest.raises(RunRefused) as e:
        check_compatible(meta, cfg | {"inputs": now}, tmp_path / "step3", world=2)
    msg = str(e.value)
    assert "the policy model's content changed: sha256 abababababab.. -> efefefefefef.." in msg
    assert "the reference model's content changed" in msg and "prepared data" not in msg
    # a checkpoint written before digests existed is judged by the model path
    old = {"world_size": 2, "run_config": dataclasses.asdict(run_config(tmp_path))}
    moved = dataclasses.asdict(run_config(tmp_path)) | {"model_path": "/elsewhere", "inputs": now}
    with pytest.raises(RunRefused, match=r"model_path: checkpoint .* != now '/elsewhere' \(the checkpoint records no"):
        check_compatible(old, moved, tmp_path / "step3", world=2)


def test_the_launch_records_the_digests_in_a_copy_and_leaves_run_json_alone(tmp_path):
    start_dirs(tmp_path)
    cfg = run_config(tmp_path)
    cfg.save(tmp_path / "run.json")
    before = (tmp_path / "run.json").read_text()
    path = identity.resolve_launch_config(tmp_path / "run.json")
    assert path == tmp_path / "out" / "run.resolved.json"
    assert (tmp_path / "run.json").read_text() == before
    assert RunConfig.load(path).inputs == identity.run_inputs(cfg)
    assert identity.resolve_launch_config(path) == path  # already resolved, unchanged
    # a probe keeps no checkpoint or cache: launched as it is
    probe = dataclasses.replace(cfg, probe_steps=2)
    probe.save(tmp_path / "probe.json")
    assert identity.resolve_launch_config(tmp_path / "probe.json") == tmp_path / "probe.json"


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (
            {"method": "ppo"},
            "method 'ppo' is not one memfit trains (allowed: 'sft', 'dpo', 'rm', 'orpo', 'simpo', 'kto')",
        ),
        ({"model_path": "meta-llama/Llama-3.1-8B"}, "model_path 'meta-llama/Llama-3.1-8B' does not exist"),
        ({"data_dir": "{tmp}/nowhere"}, "data_dir '{tmp}/nowhere' does not exist"),
        ({"data_dir": "{tmp}/model"}, "data_dir '{tmp}/model' has no train.parquet"),
        ({"ref_model_path": "{tmp}/data"}, "ref_model_path '{tmp}/data' has no config.json"),
    ],
    ids=["method", "model_path", "data_dir", "data_dir-not-prepared", "ref_model_path"],
)
def test_launch_refuses_a_bad_run_config_before_any_rank(tmp_path, capsys, monkeypatch, change, needle):
    start_dirs(tmp_path)
    change = {k: v.replace("{tmp}", str(tmp_path)) for k, v in change.items()}
    (tmp_path / "run.json").write_text(json.dumps(dataclasses.asdict(run_config(tmp_path)) | change))
    started = []
    monkeypatch.setattr(launch_mod, "launch", lambda *a, **k: started.append(a) or 0)
    rc = cli.main(["launch", "--config", str(tmp_path / "run.json"), "--nproc", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and started == []
    assert needle.replace("{tmp}", str(tmp_path)) in err and str(tmp_path / "run.json") in err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()  # nothing written


def fake_ranks(monkeypatch, code: str) -> None:
    monkeypatch.setattr(
        launch_mod,
        "command",
        lambda config, nproc, rdzv=None, rank_command="train": [sys.executable, "-c", code, str(config)],
    )


# each rank ignores the launcher's SIGTERM (sent when the first one fails) and waits for the other
# before it fails, so that both fail by themselves, as ranks running the same check do
BOTH = (
    "import os, signal, sys, time, pathlib\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "out = pathlib.Path(sys.argv[1]).parent\n"
    "(out / ('up' + os.environ['RANK'])).touch()\n"
    "while not all((out / f'up{r}').exists() for r in (0, 1)): time.sleep(0.01)\n"
)
REFUSE = BOTH + (
    "print('rank starting'); sys.stdout.flush()\n"
    "from memfit.train.run_config import RunRefused\n"
    "raise RunRefused('checkpoint /x/step3 belongs to a different run and was not loaded:\\n"
    "  the policy model\\'s content changed: sha256 ab.. -> cd..\\nDelete it (or the run directory) to start fresh.')"
)


def test_a_refusal_every_rank_raises_is_printed_once(tmp_path, monkeypatch, capfd):
    (tmp_path / "run.json").write_text(json.dumps({"out_dir": str(tmp_path / "out")}))
    fake_ranks(monkeypatch, REFUSE)
    assert launch_mod.launch(tmp_path / "run.json", 2) == 2  # REFUSED_EXIT_CODE: bad input, not a crash
    out, err = capfd.readouterr()
    assert out.count("rank starting") == 2  # the ranks' other output passes
    assert "Traceback" not in err
    assert err.count("memfit: error: checkpoint /x/step3 belongs to a different run") == 1, err
    assert "the policy model's content changed: sha256 ab.. -> cd.." in err


def test_a_crash_keeps_every_ranks_traceback(tmp_path, monkeypatch, capfd):
    (tmp_path / "run.json").write_text(json.dumps({"out_dir": str(tmp_path / "out")}))
    fake_ranks(monkeypatch, BOTH + "raise RuntimeError('rank ' + os.environ['RANK'] + ' broke')")
    assert launch_mod.launch(tmp_path / "run.json", 2) == 1
    err = capfd.readouterr().err
    assert err.count("Traceback (most recent call last):") == 2
    assert "RuntimeError: rank 0 broke" in err and "RuntimeError: rank 1 broke" in err


def test_a_refusal_in_a_log_keeps_the_tracebacks(tmp_path, monkeypatch):
    """The workflow's launches write a log: every rank's traceback stays there, for the record."""
    (tmp_path / "run.json").write_text(json.dumps({"out_dir": str(tmp_path / "out")}))
    fake_ranks(monkeypatch, REFUSE)
    assert launch_mod.launch(tmp_path / "run.json", 2, log=tmp_path / "log") == 1
    assert (tmp_path / "log").read_text().count("memfit.train.run_config.RunRefused: checkpoint") == 2


class ShardWriter:  # what DeepSpeed's engine writes, as test_fallback.py stands it in
    def save_checkpoint(self, root, tag, client_state, save_latest):
        import torch

        d = Path(root) / tag
        d.mkdir(parents=True, exist_ok=True)
        torch.save({"module": torch.zeros(10), **client_state}, d / "mp_rank_00_model_states.pt")


def test_checkpoints_of_another_model_are_set_aside_with_the_reason(tmp_path, capfd, monkeypatch):
    from memfit.train import checkpoint
    from memfit.workflow.training import set_aside_stale_checkpoints

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")

    start_dirs(tmp_path)
    cfg = identity.with_inputs(run_config(tmp_path))
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text(json.dumps({"step": 3, "split": "train", "loss": 1.0}) + "\n")
    checkpoint.save(
        ShardWriter(),
        out / "checkpoints",
        3,
        {"step": 3},
        keep_last=2,
        run_config=dataclasses.asdict(cfg),
        metrics=out / "metrics.jsonl",
    )
    assert not set_aside_stale_checkpoints(cfg, tmp_path / "train.log")  # the same run: kept
    rewrite_same_size_and_mtime(tmp_path / "model/model.safetensors", b"\x03" * 4096)
    assert set_aside_stale_checkpoints(identity.with_inputs(cfg), tmp_path / "train.log")
    assert (tmp_path / "out/checkpoints.previous/step00000003").exists()
    assert not (tmp_path / "out/checkpoints").exists()
    line = "the policy model's content changed: sha256"
    assert line in (tmp_path / "train.log").read_text() and line in capfd.readouterr().err


def test_digests_and_their_rate_from_the_command_line(tmp_path, capsys):
    model, data = start_dirs(tmp_path)
    assert identity.main([str(model), str(data), "--no-cache"]) == 0
    out = capsys.readouterr().out.splitlines()
    cfg = run_config(tmp_path)
    assert out[0].startswith(identity.run_inputs(cfg)["model"] + f"  {model}  (3 files")
    assert out[1].startswith(identity.run_inputs(cfg)["data"]) and "MB/s" in out[1]
    assert identity.main([str(tmp_path / "absent")]) == 2


def test_an_adapter_only_sft_output_is_identified_with_its_base_model(tmp_path):
    """DPO may start from an adapter-only SFT export (`export: adapter`: adapter weights and
    peft's adapter_config.json naming the base): accepted, and its identity covers the base model
    modeling loads under it, so a changed base is a changed policy."""
    base, _ = start_dirs(tmp_path)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base)}))
    (adapter / "adapter_model.safetensors").write_bytes(b"\x02" * 512)
    cfg = dataclasses.replace(run_config(tmp_path), model_path=str(adapter), ref_model_path=str(adapter))
    first = identity.run_inputs(cfg)
    assert first["ref"] == first["model"]
    (base / "model.safetensors").write_bytes(b"\x03" * 4096)
    assert identity.run_inputs(cfg)["model"] != first["model"]
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path / "gone")}))
    with pytest.raises(
        identity.InputError, match=r"adapter_config.json: base_model_name_or_path .*gone.* is not a local"
    ):
        identity.run_inputs(cfg)


def test_a_kto_run_records_its_reference_like_dpo(tmp_path, digest_cache):
    """KTO has a reference model as DPO does: its digest is recorded, so the precomputed
    reference log-probs are cached and a changed reference is seen."""
    model, data = start_dirs(tmp_path)
    cfg = RunConfig(
        method="kto",
        model_path=str(model),
        data_dir=str(data),
        out_dir=str(tmp_path / "out"),
        candidate={"zero": 0, "micro_batch": 2, "ref": "precomputed"},
    )
    inputs = identity.run_inputs(cfg)
    assert inputs["ref"] == inputs["model"]
    assert "ref" not in identity.run_inputs(run_config(tmp_path, method="sft"))
