"""Ulysses sequence parallelism (memfit.train.sequence_parallel, DeepSpeed's UlyssesSPAttentionHF):
two ranks that split every sequence train exactly what one rank with the whole sequences trains."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from memfit.data import IGNORE_INDEX
from memfit.space import Candidate
from memfit.train.sequence_parallel import SequenceShard, shard_batch


# --------------------------------------------------------------------------- the shard (no ranks)
def test_shard_keeps_each_ranks_tokens_with_global_positions_and_labels_shifted_first():
    ids = torch.arange(1, 8).unsqueeze(0)  # 7 tokens: padded to 8 for 2 ranks
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 3, 4, 5, 6, 7]])
    parts = [shard_batch({"input_ids": ids, "labels": labels}, SequenceShard(None, r, 2), pad_id=0) for r in (0, 1)]
    assert [p["input_ids"].tolist() for p in parts] == [[[1, 2, 3, 4]], [[5, 6, 7, 0]]]
    assert [p["position_ids"].tolist() for p in parts] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    # label t is what position t predicts: the boundary token 5 is rank 0's last target
    assert [p["labels"].tolist() for p in parts] == [
        [[IGNORE_INDEX, 3, 4, 5]],
        [[6, 7, IGNORE_INDEX, IGNORE_INDEX]],
    ]


def test_a_pack_keeps_its_row_positions_across_the_shards():
    """Packed rows (positions restarting at each row, as memfit.train.batches.collate_packed makes
    them): every rank keeps the pack's own positions, so flash attention finds the rows of the
    gathered sequence; no row's last token is scored against the next row's first."""
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])  # rows [1, 2, 3] and [4, 5, 6] in one pack
    labels = torch.tensor([[IGNORE_INDEX, 2, 3, IGNORE_INDEX, 5, 6]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    batch = {"input_ids": ids, "labels": labels, "position_ids": positions}
    parts = [shard_batch(batch, SequenceShard(None, r, 4), pad_id=0) for r in range(4)]  # padded to 8
    assert [p["position_ids"].tolist()[0] for p in parts] == [[0, 1], [2, 0], [1, 2], [3, 4]]
    assert [p["labels"].tolist()[0] for p in parts] == [
        [2, 3],
        [IGNORE_INDEX, 5],  # token 3 (row 1's last) predicts nothing
        [6, IGNORE_INDEX],
        [IGNORE_INDEX, IGNORE_INDEX],
    ]


def test_packing_under_sequence_parallelism_needs_flash_attention(tmp_path):
    from memfit.train.sequence_parallel import check
    from memfit.workflow.config import WorkflowConfig

    with pytest.raises(ValueError, match="packing with sequence_parallel > 1 needs attn flash"):
        check(Candidate(sequence_parallel=2, attn="sdpa"), 2, packing=True)
    check(Candidate(sequence_parallel=2, attn="flash"), 2, packing=True)  # flash finds the rows
    check(Candidate(sequence_parallel=1, attn="sdpa"), 2, packing=True)
    import yaml

    raw = yaml.safe_load((Path(__file__).parents[1] / "config/config.yaml").read_text())
    raw["search"] |= {"sequence_parallel": [1, 2], "attn": ["sdpa"]}
    raw["train"]["sft"]["packing"] = True
    cands = WorkflowConfig.load(raw).candidates("sft")
    assert cands and all(c.sequence_parallel == 1 for c in cands)  # SP=2 with sdpa is not offered


def test_a_sequence_parallel_group_shares_its_batch():
    c = Candidate(sequence_parallel=2, micro_batch=4, grad_accum=2, seq_len=32)
    assert c.data_parallel(8) == 4 and c.global_batch(8) == 32 and c.id.endswith("-sp2")
    with pytest.raises(ValueError, match="needs attn sdpa or flash"):
        Candidate(sequence_parallel=2, attn="eager")
    assert Candidate().id == Candidate(sequence_parallel=1).id  # ids of runs without it unchanged


# --------------------------------------------------------------------------- the estimator
def test_the_estimate_of_a_rank_holds_its_share_of_each_sequence():
    from memfit.estimate import estimate
    from memfit.estimate.models import catalog
    from memfit.estimate.time.costs import step_flops

    arch, gpu = catalog.model("llama-3.1-8b"), catalog.gpu("h100-80gb")
    base = Candidate(zero=3, attn="flash", grad_ckpt=True, seq_len=65536, loss_impl="chunked")
    one = estimate(arch, gpu, 8, 1, "sft", base)
    two = estimate(arch, gpu, 8, 1, "sft", dataclasses.replace(base, sequence_parallel=2))
    # activations per rank halve, but for the top layer's o_proj input, which under Ulysses is the
    # output all-to-all's own tensor (32,768 tokens x 4,096 x 2 bytes); the model states (ZeRO over
    # all 8 ranks) do not change
    o_proj_input = 32768 * 4096 * 2
    assert two.breakdown["activations"] == pytest.approx(one.breakdown["activations"] / 2 + o_proj_input, rel=0.01)
    assert two.breakdown["optimizer"] == one.breakdown["optimizer"]
    # a rank computes half the FLOPs (its tokens; attention over the whole sequence for half the
    # heads), and the all-to-all adds communication: the same tokens per second or a little less
    half = dataclasses.replace(base, seq_len=32768, sequence_parallel=2)
    assert step_flops(arch, half, "sft") == pytest.approx(step_flops(arch, base, "sft") / 2, rel=1e-9)
    assert two.time_breakdown["communication"] > one.time_breakdown["communication"]
    assert 0.9 * one.tokens_per_s < two.tokens_per_s <= one.tokens_per_s


def test_the_estimator_refuses_what_ulysses_cannot_split():
    from memfit.estimate import estimate
    from memfit.estimate.models import catalog

    arch, gpu = catalog.model("llama-3.1-8b"), catalog.gpu("h100-80gb")  # 32 heads, 8 key/value heads
    three = estimate(arch, gpu, 6, 1, "sft", Candidate(sequence_parallel=3))
    assert three.invalid and "does not split llama-3.1-8b's 32 attention heads" in three.reason
    odd = estimate(arch, gpu, 6, 1, "sft", Candidate(sequence_parallel=4))
    assert odd.invalid and "does not divide the 6 ranks" in odd.reason


def test_fit_says_how_long_a_sequence_each_sequence_parallel_size_trains(capsys):
    from memfit.estimate import fit_main

    args = ["--maximize", "seq_len", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--num-gpus", "8"]
    args += ["--zero", "3", "--attn", "flash", "--loss-impl", "chunked"]
    assert fit_main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    by_sp = {int(k): v for k, v in out["seq_len_by_sequence_parallel"].items()}
    assert list(by_sp) == [1, 2, 4, 8]  # the divisors of 8 ranks that 32 heads (8 key/value) split into
    assert by_sp[1] == out["seq_len"] < by_sp[2] <= by_sp[4] <= by_sp[8]
    assert fit_main(args) == 0
    assert f"SP=1: {by_sp[1]:,}, SP=2: {by_sp[2]:,}" in capsys.readouterr().out


# --------------------------------------------------------------------------- real runs, 2 CPU ranks
def _runs(demo_model, demo_data, tmp_path, method, sp2_levers=None, **cand):
    """The same 4 steps (global batch 8, 2 accumulated micro batches of 4, checkpoints and an
    evaluation at 2 and 4) on 1 rank with whole sequences and on 2 ranks that split them (with
    `sp2_levers` too: the tiled MLP in tiles of 6 tokens, 3 tiles of a rank's 16, padded rows;
    loss_impl chunked in chunks of 16 tokens)."""
    from concurrent.futures import ThreadPoolExecutor

    from deepspeed_runs import base_run, run

    def cfg(name, sp):
        c = base_run(demo_model, demo_data, tmp_path / name, method, micro_batch=4, grad_accum=2, **cand)
        c = dataclasses.replace(c, max_steps=4, save_every=2, eval_every=2, mlp_tile_tokens=6, loss_chunk_tokens=16)
        extra = (sp2_levers or {}) if sp == 2 else {}
        return dataclasses.replace(c, candidate=c.candidate | {"sequence_parallel": sp} | extra)

    with ThreadPoolExecutor(max_workers=2) as pool:  # independent runs: their start-ups overlap
        one, two = pool.map(lambda a: run(cfg(*a), a[1]), [("sp1", 1), ("sp2", 2)])
    return one, two


def _assert_same_training(one, two, tmp_path, rtol=1e-5):
    assert [(r["step"], r["split"]) for r in one] == [(r["step"], r["split"]) for r in two]
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "grad_norm", "rewards/margins"):
            if a.get(key) is not None:
                assert b[key] == pytest.approx(a[key], rel=rtol, abs=1e-7), (key, a, b)
    from safetensors.torch import load_file

    name = (
        "adapter_model.safetensors"
        if (tmp_path / "sp1/model/adapter_model.safetensors").exists()
        else "model.safetensors"
    )
    wa, wb = load_file(str(tmp_path / "sp1/model" / name)), load_file(str(tmp_path / "sp2/model" / name))
    assert wa.keys() == wb.keys()
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-5


# ZeRO-3 SFT and ZeRO-2 LoRA DPO without the levers: the sweep (benchmarks/sweeps.sh); the suite
# runs them with every lever (below), against the same 1-rank runs without.
@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, pytest.param(3, marks=pytest.mark.sweep)])
def test_sft_full_on_two_ranks_splitting_each_sequence_trains_what_one_rank_does(demo_model, demo_data, tmp_path, zero):
    """Losses, gradient norms (so the gradient DeepSpeed reduces is the whole sequences', at
    ZeRO-3 too, where its reduce-scatter averages over the group) and the exported weights."""
    one, two = _runs(demo_model, demo_data, tmp_path, "sft", zero=zero)
    _assert_same_training(one, two, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("zero", "finetune", "ref"), [pytest.param(2, "lora", "adapter", marks=pytest.mark.sweep), (3, "full", "model")]
)
def test_dpo_on_two_ranks_splitting_each_sequence_trains_what_one_rank_does(
    demo_model, demo_data, tmp_path, zero, finetune, ref
):
    """Chosen and rejected split alike; each sequence's log-probability (policy and reference)
    summed over the group before the DPO loss."""
    one, two = _runs(demo_model, demo_data, tmp_path, "dpo", zero=zero, finetune=finetune, ref=ref)
    _assert_same_training(one, two, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "zero", "finetune", "ref", "loss_impl"),
    [("sft", 3, "full", "model", "chunked"), ("dpo", 2, "lora", "adapter", "full")],
)
def test_the_tiled_mlp_and_activation_offload_under_sequence_parallelism_train_what_one_rank_does(
    demo_model, demo_data, tmp_path, method, zero, finetune, ref, loss_impl
):
    """SP=2 with every ALST lever (tiled MLP, checkpointing, the activation offload DeepSpeed skips
    on the CPU) against SP=1 without them: ZeRO-3 gathers the MLP's weights once per tile and
    reduces their gradients once (TiledMLP's ds_grad_is_ready), with the chunked loss over each
    rank's shifted labels; ZeRO-2 with LoRA adapters."""
    levers = {"tiled_mlp": True, "grad_ckpt": True, "activation_offload": True}
    cand = {"zero": zero, "finetune": finetune, "ref": ref, "loss_impl": loss_impl}
    one, two = _runs(demo_model, demo_data, tmp_path, method, levers, **cand)
    _assert_same_training(one, two, tmp_path)
    log = (tmp_path / "sp2/log.txt").read_text()
    assert "tiled MLP: 4 layers in tiles of 6 tokens per sequence" in log
    assert "activation offload: 4 checkpointed inputs marked, 0 moved to the host (0.0 MiB), 4 skipped" in log


@pytest.mark.slow
def test_a_sequence_parallel_run_resumes_bit_for_bit(demo_model, demo_data, tmp_path):
    from deepspeed_runs import base_run, run, run_side_by_side

    c = base_run(demo_model, demo_data, tmp_path / "full", zero=3, micro_batch=4, grad_accum=2)
    c = dataclasses.replace(c, max_steps=4, save_every=2, eval_every=2)
    c = dataclasses.replace(c, candidate=c.candidate | {"sequence_parallel": 2})
    resumed = dataclasses.replace(c, out_dir=str(tmp_path / "resumed"))
    whole, _ = run_side_by_side(c, dataclasses.replace(resumed, stop_after_step=3))  # "killed" after step 3
    rows = run(resumed, 2)  # resumes from the checkpoint at step 2
    assert [r.get("resumed_from_step") for r in rows if r["split"] == "train"] == [None, None, 2, None]
    assert [(r["step"], r["split"], r["loss"]) for r in rows] == [(r["step"], r["split"], r["loss"]) for r in whole]
    summary = json.loads((Path(resumed.out_dir) / "summary.json").read_text())
    assert summary["world_size"] == 2
