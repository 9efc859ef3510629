"""Chunked vs full vocabulary loss in the real trainer: DeepSpeed on 2 CPU ranks (gloo).

The demo model ties its head to the embeddings, so ZeRO-3 exercises the hard case: the head's
partitioned weight is gathered by DeepSpeed's hooks around the head module, and the chunked
backward hands its gradient back once per step (memfit.train.vocab_loss).
"""

import dataclasses

import pytest
from deepspeed_runs import base_run, run_side_by_side

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(demo_data):
    return demo_data


CASES = {  # id: (method, candidate fields, dpo loss)
    "sft-z0": ("sft", {"zero": 0}, None),
    "sft-z3-lora": ("sft", {"zero": 3, "finetune": "lora", "lora_rank": 8}, None),
    "dpo-sigmoid-z3-ref-model": ("dpo", {"zero": 3, "ref": "model", "micro_batch": 4}, "sigmoid"),
    "dpo-ipo-z2-lora-ref-adapter": (
        "dpo",
        {"zero": 2, "finetune": "lora", "lora_rank": 8, "ref": "adapter", "micro_batch": 4},
        "ipo",
    ),
    "dpo-hinge-z2-precomputed": ("dpo", {"zero": 2, "ref": "precomputed", "micro_batch": 4}, "hinge"),
}


# ZeRO-0 SFT (no partitioned head to gather): the sweep (benchmarks/sweeps.sh)
SWEEP = {"sft-z0"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.sweep) if c in SWEEP else c for c in CASES])
def test_chunked_trains_as_full(demo_model, data, tmp_path, case):
    method, cand, loss_type = CASES[case]
    cfgs = {}
    for impl in ("full", "chunked"):
        cfg = base_run(demo_model, data, tmp_path / impl, method=method, **cand, loss_impl=impl)
        cfgs[impl] = dataclasses.replace(
            cfg,
            max_steps=3,
            save_every=0,
            eval_every=3,
            export=False,
            loss_chunk_tokens=16,  # several chunks per micro batch
            dpo={"beta": 0.1, "loss_type": loss_type} if loss_type else {},
        )
    rows = dict(zip(cfgs, run_side_by_side(*cfgs.values()), strict=True))
    keys = [k for k in rows["full"][0] if k == "loss" or k.startswith(("rewards/", "logps/"))]
    assert "loss" in keys and (method == "sft" or "logps/chosen" in keys)
    pairs = [(f, c) for f, c in zip(rows["full"], rows["chunked"], strict=True) if "loss" in f]
    assert len(pairs) >= 4  # 3 train steps and the final evaluation
    for f, c in pairs:
        assert (f["step"], f["split"]) == (c["step"], c["split"])
        # A step whose policy still equals the reference (the first steps train at the warmup's
        # lr 0) has chosen and rejected rewards of 0 up to rounding: which one is larger is decided
        # by the last bit, which the two loss implementations round apart.
        tie = max(abs(f.get("rewards/chosen", 1.0)), abs(f.get("rewards/rejected", 1.0))) < 1e-6
        for k in keys:
            if k in f and not (tie and k == "rewards/accuracies"):
                assert c[k] == pytest.approx(f[k], rel=1e-6, abs=1e-6), (case, f["step"], f["split"], k)
