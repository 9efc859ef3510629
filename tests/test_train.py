"""Real DeepSpeed runs on the CPU accelerator with 2 ranks (gloo): the trainer users run."""

import dataclasses
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from deepspeed_runs import base_run, run, run_side_by_side
from safetensors.torch import load_file

from memfit.train.launch import launch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(demo_data):
    return demo_data


def losses(rows, split="train"):
    return [r["loss"] for r in rows if r["split"] == split]


@pytest.fixture(scope="module")
def zero3_run(shared_runs):
    """The ZeRO-3 SFT run (conftest `shared_runs`, read-only): (run directory, metrics rows)."""
    return shared_runs["sft-z3"]


def test_sft_learns_and_zero_stages_agree(shared_runs, zero3_run):
    shared_runs.prefetch("sft-z0", "sft-z2")
    _, ref_rows = zero3_run
    ref = losses(ref_rows)
    assert len(ref) == 6
    ev = losses(ref_rows, "eval")
    assert ev[-1] < ev[0] * 0.8, f"held-out loss did not fall: {ev}"
    for stage in (0, 2):
        _, rows = shared_runs[f"sft-z{stage}"]
        assert losses(rows) == pytest.approx(ref, rel=1e-4), f"ZeRO-{stage} differs from ZeRO-3"


def test_optimizer_offload_trains_the_same(demo_model, data, tmp_path, zero3_run):
    _, ref_rows = zero3_run
    got = losses(run(base_run(demo_model, data, tmp_path / "off", zero=2, offload_optimizer="cpu")))
    assert got == pytest.approx(losses(ref_rows), rel=1e-4)


def test_resume_after_interruption_continues_exactly(shared_runs, zero3_run):
    ref_dir, ref_rows = zero3_run
    out, rows = shared_runs["sft-z3-resumed"]  # resume: auto picks step 3 and re-does step 4
    first, exported = shared_runs.first_rows["sft-z3-resumed"]  # "killed" after step 4; checkpoint at 3
    assert max(r["step"] for r in first) == 4
    assert not exported  # the interrupted launch wrote no model
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resume_peak_allocated_bytes"] > 0  # loading the checkpoint is measured on its own
    assert json.loads((ref_dir / "summary.json").read_text())["resume_peak_allocated_bytes"] is None
    assert [(r["step"], r["split"]) for r in rows] == [(r["step"], r["split"]) for r in ref_rows]
    assert losses(rows) == losses(ref_rows)  # bit for bit
    a = load_file(str(ref_dir / "model/model.safetensors"))
    b = load_file(str(out / "model/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_a_checkpoint_of_another_run(demo_model, data, tmp_path, zero3_run):
    ref_dir, _ = zero3_run
    cfg = dataclasses.replace(
        base_run(demo_model, data, tmp_path / "other", zero=3, micro_batch=4, grad_accum=2),
        resume=str(ref_dir / "checkpoints/step00000003"),
    )
    Path(cfg.out_dir).mkdir(parents=True)
    cfg.save(Path(cfg.out_dir) / "run.json")
    rc = launch(Path(cfg.out_dir) / "run.json", 2, log=Path(cfg.out_dir) / "log.txt", timeout_s=600)
    assert rc != 0
    assert "belongs to a different run" in (Path(cfg.out_dir) / "log.txt").read_text()


@pytest.fixture(scope="module")
def dpo_ref_runs(demo_model, data, tmp_path_factory):
    """DPO (3 steps, micro batch 8) with the frozen reference model held (`ref=model`) and with its
    log-probs precomputed (`ref=precomputed`): zero -> {ref: (dir, rows)}, both runs of a ZeRO
    stage made at its first use (ZeRO-3 in the suite, ZeRO-2 in the sweep, benchmarks/sweeps.sh)."""
    root = tmp_path_factory.mktemp("dpo-ref")
    done: dict[int, dict[str, tuple[Path, list[dict]]]] = {}

    def get(zero: int) -> dict[str, tuple[Path, list[dict]]]:
        if zero not in done:
            cfgs = {
                ref: dataclasses.replace(
                    base_run(
                        demo_model,
                        data,
                        root / f"z{zero}-{ref}",
                        method="dpo",
                        zero=zero,
                        micro_batch=8,
                        grad_accum=1,
                        ref=ref,
                    ),
                    max_steps=3,
                )
                for ref in ("model", "precomputed")
            }
            got = run_side_by_side(*cfgs.values())
            done[zero] = {ref: (Path(cfg.out_dir), rows) for (ref, cfg), rows in zip(cfgs.items(), got, strict=True)}
        return done[zero]

    return get


def test_dpo_with_frozen_reference_reports_trl_metrics(dpo_ref_runs):
    out, rows = dpo_ref_runs(3)["model"]
    train = [r for r in rows if r["split"] == "train"]
    for key in (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
    ):
        assert key in train[0], key
    # policy == reference at step 1: the first loss is log(2) exactly as in the DPO paper
    assert train[0]["loss"] == pytest.approx(0.6931, abs=1e-3)
    assert train[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert (out / "model/model.safetensors").exists()


LORA = {"finetune": "lora", "lora_rank": 8, "grad_ckpt": True}


@pytest.fixture(scope="module")
def lora_runs(demo_model, data, tmp_path_factory):
    """The LoRA SFT run exporting the merged model and the same run exporting the adapter only:
    (zero, "merged" | "adapter") -> (dir, rows), made at first use; under ZeRO-2 both side by side,
    under ZeRO-3 (slower: one test may take at most 60 s) each alone."""
    done: dict[tuple[int, str], tuple[Path, list[dict]]] = {}

    def get(zero: int, fmt: str) -> tuple[Path, list[dict]]:
        if (zero, fmt) not in done:
            fmts = ("merged", "adapter") if zero == 2 else (fmt,)
            dirs = {f: tmp_path_factory.mktemp(f"lora-{f}-z{zero}") for f in fmts}
            cfgs = [
                dataclasses.replace(base_run(demo_model, data, d, zero=zero, **LORA), export_format=f)
                for f, d in dirs.items()
            ]
            for f, rows in zip(dirs, run_side_by_side(*cfgs), strict=True):
                done[(zero, f)] = (dirs[f], rows)
        return done[(zero, fmt)]

    return get


@pytest.fixture(scope="module")
def lora_merged(lora_runs):
    """A LoRA SFT run (ZeRO-2) exporting the merged model: (run dir, metrics)."""
    return lora_runs(2, "merged")


def test_lora_exports_a_merged_model_transformers_loads(demo_model, lora_merged):
    from transformers import AutoModelForCausalLM

    out, rows = lora_merged
    assert losses(rows)[-1] < losses(rows)[0]
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    base = AutoModelForCausalLM.from_pretrained(demo_model)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in base.parameters())
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, dict(base.named_parameters())[n])]
    assert any("q_proj" in n for n in changed) and not any("norm" in n for n in changed)


def test_sigterm_checkpoints_the_current_step_and_the_rerun_resumes(demo_model, data, tmp_path, zero3_run):
    """What SLURM does before a wall-time kill: SIGTERM to the job; memfit saves and exits to be resumed."""
    import signal
    import subprocess
    import sys
    import time

    from memfit.train.run_config import PREEMPTED_EXIT_CODE

    _, ref_rows = zero3_run
    cfg = dataclasses.replace(base_run(demo_model, data, tmp_path / "sig", zero=3), save_every=0)
    Path(cfg.out_dir).mkdir(parents=True)
    cfg.save(Path(cfg.out_dir) / "run.json")
    code = (
        "import sys; from pathlib import Path; from memfit.train.launch import launch; "
        f"sys.exit(launch(Path('{cfg.out_dir}/run.json'), 2, log=Path('{cfg.out_dir}/log.txt')))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    metrics = Path(cfg.out_dir) / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and '"step": 2,' in metrics.read_text()):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == PREEMPTED_EXIT_CODE
    log = (Path(cfg.out_dir) / "log.txt").read_text()
    assert "signal received: checkpointed step" in log
    assert list((Path(cfg.out_dir) / "checkpoints").glob("step*/COMPLETE"))  # saved although save_every=0
    rows = run(cfg)  # the re-run resumes and finishes the same trajectory
    assert "resumed from" in (Path(cfg.out_dir) / "log.txt").read_text()
    assert losses(rows) == losses(ref_rows)


@pytest.mark.parametrize("zero", [pytest.param(2, marks=pytest.mark.sweep), 3])
def test_precomputed_reference_trains_the_same_with_less_memory(demo_model, dpo_ref_runs, zero):
    """ref=precomputed: reference log-probs from one pass before training; no reference model held."""
    pre_dir, pre = dpo_ref_runs(zero)["precomputed"]
    _, with_model = dpo_ref_runs(zero)["model"]
    assert losses(pre) == pytest.approx(losses(with_model), rel=1e-5)
    assert losses(pre, "eval") == pytest.approx(losses(with_model, "eval"), rel=1e-5)
    assert (pre_dir / "ref_logps.safetensors").exists()
    peak = {
        name: max(r["peak_allocated_bytes"] for r in rows if r["split"] == "train")
        for name, rows in (("model", with_model), ("pre", pre))
    }
    # The frozen reference's weights are gone from training: at least its share per rank (a full
    # fp32 replica under ZeRO-2, 1/world of it under ZeRO-3, where DeepSpeed kept the precompute
    # pass's partitions alive until memfit dropped them from its module stack).
    n_params = sum(t.numel() for t in load_file(demo_model / "model.safetensors").values())
    ref_share = 4 * n_params // (2 if zero == 3 else 1)
    assert peak["model"] - peak["pre"] >= ref_share, (peak, ref_share)
    assert "reference model released: 0.0 MiB of its parameters still allocated" in (pre_dir / "log.txt").read_text()


def test_sigkill_during_a_checkpoint_save_then_resume_is_bit_exact(demo_model, data, tmp_path, zero3_run):
    """kill -9 of the whole job while a checkpoint is being written, an older one complete beside
    it; the re-run resumes from the newest complete checkpoint (the half-written one ignored, the
    killed step's metrics row dropped) and ends equal to the uninterrupted run bit for bit (losses
    and weights). A kill between saves resumes as a stop does (`sft-z3-resumed`, SIGTERM below)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    ref_dir, ref_rows = zero3_run
    cfg = dataclasses.replace(base_run(demo_model, data, tmp_path / "kill", zero=3), save_every=1)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True)
    cfg.save(out / "run.json")
    code = (
        "import sys; from pathlib import Path; from memfit.train.launch import launch; "
        f"sys.exit(launch(Path('{out}/run.json'), 2, log=Path('{out}/log.txt')))"
    )
    # ranks started as interpreters, as for users: they die with their parent (PR_SET_PDEATHSIG)
    env = {k: v for k, v in os.environ.items() if k != "MEMFIT_RANK_SERVER"}
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, env=env)
    ckpts = out / "checkpoints"
    deadline = time.time() + 300
    caught = False
    while time.time() < deadline and proc.poll() is None and not caught:
        steps = list(ckpts.glob("step*")) if ckpts.exists() else []
        complete = [p for p in steps if (p / "COMPLETE").exists()]
        caught = bool(complete) and any(not (p / "COMPLETE").exists() for p in steps)
        time.sleep(0.005)
    assert caught, "no checkpoint save was caught in progress beside a complete one"
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and torchrun; ranks die with their parent
    proc.wait()
    time.sleep(1.0)
    rows = run(cfg)  # the re-run that finishes
    assert "resumed from" in (out / "log.txt").read_text()
    assert [(r["step"], r["split"]) for r in rows] == [(r["step"], r["split"]) for r in ref_rows]
    assert losses(rows) == losses(ref_rows)
    a = load_file(str(ref_dir / "model/model.safetensors"))
    b = load_file(str(out / "model/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- adapter-only export
def _logits(model, demo_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model)
    ids = tok(["What comes after 417?", "Which is larger, 23 or 71?"], return_tensors="pt", padding=True)
    with torch.no_grad():
        return model(**ids).logits


@pytest.fixture(scope="module")
def lora_adapter(lora_runs):
    """The same LoRA SFT run as lora_merged, exporting the adapter only: ZeRO stage -> (dir, rows)."""

    class ByStage:
        def __getitem__(self, stage: int) -> tuple[Path, list[dict]]:
            return lora_runs(stage, "adapter")

    return ByStage()


@pytest.mark.parametrize("stage", [2, 3])
def test_adapter_export_equals_the_merged_model(demo_model, lora_merged, lora_adapter, stage):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged_dir, merged_rows = lora_merged
    out, rows = lora_adapter[stage]
    files = {p.name for p in (out / "model").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= files
    assert "model.safetensors" not in files and not (out / "model.tmp").exists()
    assert json.loads((out / "model/adapter_config.json").read_text())["base_model_name_or_path"] == str(demo_model)
    assert losses(rows) == pytest.approx(losses(merged_rows), rel=1e-4)
    base = AutoModelForCausalLM.from_pretrained(demo_model)
    before = _logits(base, demo_model)
    adapted = PeftModel.from_pretrained(base, out / "model").eval()
    got = _logits(adapted, demo_model)
    want = _logits(AutoModelForCausalLM.from_pretrained(merged_dir / "model").eval(), demo_model)
    assert (got - before).abs().max() > 1e-2  # the adapter is trained, not its zero init
    # ZeRO-2 repeats the merged run's trajectory; ZeRO-3 agrees to its rounding (losses within 1e-4)
    torch.testing.assert_close(got, want, atol=1e-5 if stage == 2 else 2e-3, rtol=1e-4)


def test_load_model_merges_an_adapter_only_directory(demo_model, lora_merged, lora_adapter, tmp_path):
    from transformers import AutoModelForCausalLM

    from memfit.space import Candidate
    from memfit.train.modeling import load_model

    merged_dir, _ = lora_merged
    out, _ = lora_adapter[2]
    cand = Candidate.from_dict({"attn": "sdpa", "precision": "fp32"})
    model = load_model(str(out / "model"), cand, trainable=True)  # full fine-tune from the merged SFT model
    assert not hasattr(model, "peft_config") and all(p.requires_grad for p in model.parameters())
    want = _logits(AutoModelForCausalLM.from_pretrained(merged_dir / "model").eval(), demo_model)
    torch.testing.assert_close(_logits(model.eval(), demo_model), want, atol=1e-5, rtol=1e-4)
    moved = tmp_path / "adapter"
    shutil.copytree(out / "model", moved)
    cfg = json.loads((moved / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(tmp_path / "gone")
    (moved / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match="base_model_name_or_path .*gone.* is not a local model directory"):
        load_model(str(moved), cand, trainable=False)


def test_dpo_starts_from_an_adapter_only_sft_output(demo_model, data, lora_merged, lora_adapter, tmp_path):
    """SFT(adapter) -> DPO under ZeRO-3 (the adapter merged into the partitioned base, policy and
    reference) trains as DPO from the merged SFT export does."""
    merged_dir, _ = lora_merged
    out, _ = lora_adapter[2]
    cfgs = {}
    for name, start in (("merged", merged_dir / "model"), ("adapter", out / "model")):
        cfg = base_run(demo_model, data, tmp_path / name, method="dpo", zero=3, micro_batch=4, grad_accum=2)
        cfgs[name] = dataclasses.replace(
            cfg, model_path=str(start), ref_model_path=str(start), max_steps=3, save_every=0
        )
    runs = dict(zip(cfgs, run_side_by_side(*cfgs.values()), strict=True))
    assert losses(runs["adapter"])[0] == pytest.approx(0.6931, abs=1e-3)  # policy == reference at step 1
    assert losses(runs["adapter"]) == pytest.approx(losses(runs["merged"]), rel=1e-4)
    assert losses(runs["adapter"], "eval") == pytest.approx(losses(runs["merged"], "eval"), rel=1e-4)


# --------------------------------------------------------------------------- packing
def test_packed_sft_trains_under_zero3_and_probes_full_packs(demo_model, data, tmp_path):
    from memfit.workflow.probe import run_probe

    cfg = dataclasses.replace(
        base_run(demo_model, data, tmp_path / "packed", zero=3, micro_batch=4, grad_accum=1),
        packing=True,
        loss_on="all",
    )
    rows = run(cfg)
    summary = json.loads((tmp_path / "packed/summary.json").read_text())
    p = summary["packing"]
    n_train = len(pq.read_table(data / "sft/train.parquet"))
    assert p["rows"] == n_train and p["capacity"] == 32 and p["packs"] < n_train and 0.5 < p["fill"] <= 1
    train = [r for r in rows if r["split"] == "train"]
    assert len(train) == 6 and all(r["tokens_per_s"] > 0 for r in train)
    ev = losses(rows, "eval")
    assert ev[-1] < ev[0] * 0.8, f"held-out loss did not fall: {ev}"
    res = run_probe(
        dataclasses.replace(cfg, out_dir=str(tmp_path / "probe")),
        nproc=2,
        out_json=tmp_path / "probe.json",
        log=tmp_path / "probe.log",
        steps=2,
    )
    assert res["status"] == "ok", res
    assert res["packing"] == p  # the probe packs the same rows, then runs the fullest packs padded to seq_len
    assert res["peak_allocated_bytes"] >= max(r["peak_allocated_bytes"] for r in train)


def test_lora_merged_export_under_zero3_equals_zero2(lora_merged, lora_runs):
    """export: merged with LoRA under ZeRO-3 (weights partitioned at export) gives the ZeRO-2 model."""
    merged_dir, merged_rows = lora_merged
    z3_dir, rows = lora_runs(3, "merged")
    assert losses(rows) == pytest.approx(losses(merged_rows), rel=1e-4)
    a = load_file(str(merged_dir / "model/model.safetensors"))
    b = load_file(str(z3_dir / "model/model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=2e-4, rtol=1e-3)
