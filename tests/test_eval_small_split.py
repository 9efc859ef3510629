"""A held-out split smaller than micro_batch x (ranks - 1) rows, on 2 CPU ranks (gloo): one rank
evaluates only dummy batches and must still reduce the same metrics as the other (#43: DPO with
48 pairs, micro batch 8, failed with gloo's "collective mismatch" at the first evaluation)."""

import pytest
from conftest import REPO
from deepspeed_runs import base_run, run

from memfit.data import prepare
from memfit.data.shards import load_split

pytestmark = pytest.mark.slow

REPO_DPO = "data/demo/dpo.jsonl"


def test_dpo_eval_split_smaller_than_one_batch_per_rank(demo_model, tmp_path):
    data = tmp_path / "data"
    prepare("dpo", REPO / REPO_DPO, demo_model, data / "dpo", max_len=32, eval_fraction=0.003)
    n_eval = len(load_split(data / "dpo", "eval"))
    assert 0 < n_eval <= 8  # micro batch 8, 2 ranks: rank 1 gets no real row
    cfg = base_run(demo_model, data, tmp_path / "run", method="dpo", zero=2)
    cfg.max_steps, cfg.eval_every, cfg.save_every = 2, 2, 0
    rows = run(cfg)
    evals = [r for r in rows if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2]
    for r in evals:  # the DPO metrics of the real rows, not a lone "loss" of a rank that saw none
        assert r["loss"] > 0
        assert {"loss", "rewards/accuracies", "rewards/margins"} <= set(r), sorted(r)
        assert 0.0 <= r["rewards/accuracies"] <= 1.0
