"""Training that runs out of device memory mid-run completes on the next candidate, from its
checkpoint (memfit.workflow.pipeline.train -> memfit.workflow.fallback). Real DeepSpeed on 2 CPU ranks (gloo), the
cpu device's capacity enforced by memfit.train.memory.AllocationTracker."""

import dataclasses
import json
from pathlib import Path

import pytest
from deepspeed_runs import base_run, run

from memfit.estimate.rows import Budget, CandidateRow, Prediction, Selection
from memfit.space import Candidate
from memfit.train import checkpoint
from memfit.workflow import pipeline
from memfit.workflow.resume_check import verify_resume

pytestmark = pytest.mark.slow

# ZeRO-2, micro batch 8: fits the first steps, then a longer batch crosses the capacity. ZeRO-3 with
# micro batch 4 x grad_accum 2 (the same global batch of 16 rows on 2 ranks) holds a quarter less.
FIRST = {"zero": 2, "micro_batch": 8, "grad_accum": 1}
SECOND = {"zero": 3, "micro_batch": 4, "grad_accum": 2}
# Live bytes per rank. Uninterrupted runs on this data measured (AllocationTracker, bytes live
# per rank): FIRST 51,158,424 over steps 1-3 and 98,921,880 from step 4 (the first long batch);
# SECOND 65,689,437 over all 8 steps. 80 MiB lies between.
CAPACITY = 80 * 2**20


SEED = 2  # with it, steps 1-3 of FIRST draw only short rows, step 4 the first long one (asserted below)


@pytest.fixture(scope="module")
def mixed_data(demo_model, tmp_path_factory, repo):
    """240 demo SFT rows, every 20th asking five questions at once: a long row (76-82 tokens)
    among short ones (15-18 tokens), so that a later batch needs more memory than the first ones."""
    from memfit.data import prepare

    rows = [json.loads(line) for line in (repo / "data/demo/sft.jsonl").read_text().splitlines()[:240]]
    for i in range(7, len(rows), 20):
        qs = rows[i : i + 5]
        rows[i] = {
            "prompt": " ".join(q["prompt"] for q in qs),
            "response": " ".join(q["response"] for q in qs),
        }
    root = tmp_path_factory.mktemp("mixed")
    (root / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare("sft", root / "mixed.jsonl", demo_model, root / "sft", max_len=96, eval_fraction=0.05)
    return root


def longest_per_step(data_dir, cand, steps=8):
    from memfit.data import load_split
    from memfit.train.batches import Schedule

    lengths = [len(r["input_ids"]) for r in load_split(data_dir, "train")]
    s = Schedule(len(lengths), cand["micro_batch"], cand["grad_accum"], 2, SEED)
    return [max(lengths[i] for r in range(2) for idx in s.micro_batches(k, r) for i in idx) for k in range(steps)]


def ranking_of(cfg, cands):
    """selected.json as select_config writes it, with the test's premise as verdicts: each
    candidate fits (no figures: the fallback then judges nothing by memory)."""
    rows = []
    for c in cands:
        full = Candidate.from_dict({**cfg.candidate, **c})
        pred = Prediction(None, None, None, None, None, True)
        rows.append(
            CandidateRow(
                id=full.id,
                candidate=full.to_dict(),
                predicted=pred,
                source="predicted",
                fits=True,
                reason="",
            )
        )
    return Selection(
        model="demo-tiny",
        gpu="cpu",
        method="sft",
        selected=rows[0],
        budget=Budget(CAPACITY, 10**12, 0.0),
        plan_only=False,
        launch="memfit launch",
        candidates=rows,
    ).to_json()


def metrics(d: Path) -> list[dict]:
    return [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def fallen_back(demo_model, mixed_data, tmp_path_factory):
    """The job as the workflow's train rule runs it (pipeline.train): FIRST runs out of memory at
    step 4, SECOND completes from the checkpoint of step 3. (run config, summary, job directory)."""
    longest = longest_per_step(mixed_data / "sft", FIRST)
    assert max(longest[:3]) <= 18 and longest[3] >= 76, longest  # the premise: short steps 1-3, a long step 4
    job = tmp_path_factory.mktemp("fallback") / "sft"
    train_dir = job / "train"
    cfg = dataclasses.replace(
        base_run(demo_model, mixed_data, train_dir, **FIRST),
        max_steps=8,
        keep_last=10,
        seed=SEED,
        device_capacity_bytes=CAPACITY,
    )
    cfg = dataclasses.replace(cfg, candidate=Candidate.from_dict(cfg.candidate).to_dict())
    job.mkdir(parents=True)
    cfg.save(job / "run.json")
    (job / "selected.json").write_text(json.dumps(ranking_of(cfg, [FIRST, SECOND])))
    return cfg, pipeline.train(job / "run.json", 2, job / "train.log"), job


def test_training_that_runs_out_of_memory_completes_on_the_next_candidate_from_its_checkpoint(fallen_back):
    cfg, summary, job = fallen_back
    train_dir, log = job / "train", job / "train.log"
    second = Candidate.from_dict({**cfg.candidate, **SECOND})
    [fb] = summary["fallbacks"]
    print("fallback:", fb)
    assert fb["from"] == cfg.cand.id and fb["to"] == second.id
    assert fb["capacity_bytes"] == CAPACITY and fb["bytes_live"] > CAPACITY
    assert fb["phase"] in ("forward", "backward", "optimizer step", "evaluation", "checkpoint save")
    assert fb["oom_step"] == 4 and fb["resumed_from_step"] == 3  # the first long batch, the checkpoint before it
    assert summary["trained_candidate"] == second.id
    assert f"memfit: OOM fallback 1: {cfg.cand.id} ran out of device memory at step {fb['oom_step']}" in log.read_text()
    assert not list(train_dir.glob("oom.rank*.json"))
    # nothing half-written: every checkpoint directory is published
    ckpts = train_dir / "checkpoints"
    assert all((d / checkpoint.COMPLETE).exists() for d in ckpts.glob("step*"))
    # one curve: each (step, split) once, in order, up to the last step
    rows = metrics(train_dir)
    keys = [(r["step"], r["split"]) for r in rows]
    assert len(keys) == len(set(keys)) and [k[0] for k in keys] == sorted(k[0] for k in keys)
    assert [s for s, split in keys if split == "train"] == list(range(1, 9))
    assert [s for s, split in keys if split == "eval"] == [0, 3, 6, 8]


def test_after_the_switch_the_losses_are_those_of_the_new_candidate_run_from_that_checkpoint(fallen_back, tmp_path):
    """The new candidate run uninterrupted from that same checkpoint gives the same losses."""
    cfg, summary, job = fallen_back
    [fb] = summary["fallbacks"]
    second = Candidate.from_dict({**cfg.candidate, **SECOND})
    rows = metrics(job / "train")
    ckpts = job / "train/checkpoints"
    start = fb["resumed_from_step"]
    ref_cfg = dataclasses.replace(
        cfg,
        candidate=second.to_dict(),
        fallback=1,
        out_dir=str(tmp_path / "ref"),
        resume=str(ckpts / checkpoint.tag_for(start)),
    )
    ref = run(ref_cfg)
    after = [(r["step"], r["split"], r["loss"]) for r in rows if r["step"] > start]
    want = [(r["step"], r["split"], r["loss"]) for r in ref if r["step"] > start]
    assert [a[:2] for a in after] == [w[:2] for w in want]
    worst = max(abs(a[2] - w[2]) / abs(w[2]) for a, w in zip(after, want, strict=True))
    print(
        f"losses after the switch vs the uninterrupted run of {second.id} from step {start}: max relative difference {worst:.2e}"
    )
    assert worst <= 1e-6
    assert [r for r in rows if r["step"] <= start] == [r for r in ref if r["step"] <= start]  # the checkpoint's curve


def test_verify_resume_resumes_the_run_the_fallback_finished(fallen_back):
    """verify_resume resumes the finished run (now the fallback candidate) from its previous checkpoint."""
    _, _, job = fallen_back
    res = verify_resume(job / "run.json", 2, job / "verify_resume.json", job / "verify_resume.log")
    assert res["passed"], res
