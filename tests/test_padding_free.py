"""The padding_free lever (run config `padding_free: true`, docs/speed.md): an SFT, DPO, reward-model,
ORPO or SimPO micro batch runs as one row of its sequences concatenated, position ids restarting per
sequence, instead of a padded batch. Its losses and gradients equal the padded batch's in fp32 (SFT:
the per-token mean over the same tokens; DPO: each sequence's summed response log-probs; rm: each
sequence's reward at its last token; ORPO and SimPO: each response's mean log-prob and the chosen
NLL), and a run config that asks for it where it does not apply (KTO) is refused at the CLI, naming
the key."""

from __future__ import annotations

import json

import pytest
import torch

from memfit import cli, data
from memfit.space import Candidate
from memfit.train.batches import dpo_padding_free_batch, padding_free_batch
from memfit.train.modeling import attn_implementation, load_model
from memfit.train.steps import StepRunner


@pytest.fixture(scope="module")
def sft_rows(demo_model, tmp_path_factory, repo):
    out = tmp_path_factory.mktemp("sft") / "prepared"
    data.prepare("sft", repo / "data/demo/sft.jsonl", demo_model, out, max_len=32, eval_fraction=0.0)
    return data.load_split(out, "train")


def mixed_rows(rows, n=8):
    """Rows of different lengths: the padded batch then holds padding the padding-free row drops."""
    by_len = {}
    for r in rows:
        by_len.setdefault(len(r["input_ids"]), r)
    picked = list(by_len.values())
    return (picked * n)[:n]


def loss_and_grads(demo_model, rows, attn, loss_on, padding_free):
    torch.manual_seed(0)
    cand = Candidate.from_dict({"attn": attn, "precision": "fp32", "padding_free": padding_free})
    model = load_model(str(demo_model), cand, trainable=True)  # padding_free sdpa: memfit's per-sequence sdpa
    model.train()
    runner = StepRunner("sft", model, None, 0, loss_on=loss_on, padding_free=padding_free)
    loss, metrics, tokens = runner.loss(rows)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), metrics, tokens, grads


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("loss_on", ["response", "all"])
def test_padding_free_loss_and_gradients_equal_the_padded_batch(demo_model, sft_rows, attn, loss_on):
    """fp32: the losses agree within 1e-5 (the same tokens' log-probs, summed in another order: the
    per-row attention sees exactly the keys it sees padded), the gradients within 1e-5 relative;
    and the padding-free row holds only the rows' tokens, where the padded batch holds more."""
    rows = mixed_rows(sft_rows)
    lengths = [len(r["input_ids"]) for r in rows]
    assert len(set(lengths)) > 1, "the demo rows must differ in length for padding to exist"
    pad_loss, pad_m, pad_tokens, pad_grads = loss_and_grads(demo_model, rows, attn, loss_on, False)
    free_loss, free_m, free_tokens, free_grads = loss_and_grads(demo_model, rows, attn, loss_on, True)
    assert free_loss == pytest.approx(pad_loss, abs=1e-5)
    assert free_m["loss"] == pytest.approx(pad_m["loss"], abs=1e-4)  # loss x rows, for the epoch mean
    assert free_tokens == pad_tokens == sum(lengths)
    assert pad_grads.keys() == free_grads.keys()
    for name, g in pad_grads.items():
        torch.testing.assert_close(free_grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
    batch = padding_free_batch(rows, 0, loss_on)
    assert batch["input_ids"].shape == (1, sum(lengths)) < (1, len(rows) * max(lengths))
    starts = [0] + list(torch.tensor(lengths).cumsum(0)[:-1])
    assert all(int(batch["position_ids"][0, s]) == 0 for s in starts)  # positions restart per row


def test_padding_free_rows_do_not_see_each_other(demo_model, sft_rows):
    """The equality above is not vacuous: the same concatenated row run as one causal sequence
    (no position ids, so no per-row mask) gives another loss."""
    rows = mixed_rows(sft_rows)
    cand = Candidate.from_dict({"attn": "sdpa", "precision": "fp32", "padding_free": True})
    model = load_model(str(demo_model), cand, trainable=False)
    runner = StepRunner("sft", model, None, 0, padding_free=True)
    with torch.no_grad():
        free = float(runner.loss(rows)[0])
        b = padding_free_batch(rows, 0)
        leaky = float(runner._sft(b["labels"], input_ids=b["input_ids"], use_cache=False)[0])
    assert abs(free - leaky) > 1e-3


def test_probe_pads_the_padding_free_row_to_the_padded_worst_case(demo_model, sft_rows):
    """A probe (pad_to = seq_len) runs the row at rows x seq_len tokens: the largest shape training
    can meet, counted as the rows' own tokens."""
    rows = mixed_rows(sft_rows, 4)
    batch = padding_free_batch(rows, 0, pad_to=4 * 32)
    assert batch["input_ids"].shape == (1, 128)
    assert int((batch["labels"] != -100).sum()) == int((padding_free_batch(rows, 0)["labels"] != -100).sum())


def dpo_loss_and_grads(demo_model, rows, ref, padding_free, loss_impl="full"):
    torch.manual_seed(0)
    cand = Candidate.from_dict({"attn": "sdpa", "precision": "fp32", "padding_free": padding_free})
    model = load_model(str(demo_model), cand, trainable=True)
    model.train()
    ref_model = load_model(str(demo_model), cand, trainable=False) if ref == "model" else None
    if ref_model is not None:  # a reference that differs from the policy, so the log-ratios are not 0
        with torch.no_grad():
            for p in ref_model.parameters():
                p.mul_(0.9)
    runner = StepRunner(
        "dpo", model, ref_model, 0, dpo={"beta": 0.1}, ref=ref, padding_free=padding_free, loss_impl=loss_impl
    )
    loss, metrics, tokens = runner.loss(rows)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), metrics, tokens, grads


@pytest.mark.parametrize("ref, loss_impl", [("model", "full"), ("precomputed", "full"), ("model", "chunked")])
def test_dpo_padding_free_equals_the_padded_batch(demo_model, mixed_dpo_pairs, ref, loss_impl):
    """DPO's chosen and rejected sequences of four pairs of mixed lengths as one row: the loss, every
    metric (rewards, margins, accuracies, log-probs) and the gradients equal the padded [8, L] batch's
    within 1e-5 in fp32, with the reference as a model (its own forward of the same row) or precomputed,
    and with the chunked loss; the row holds the sequences' tokens only."""
    rows = [dict(r) for r in mixed_dpo_pairs[0]]
    for r in rows:  # precomputed reference log-probs, as the run's pass before training writes them
        r["ref_chosen_logps"], r["ref_rejected_logps"] = -float(len(r["chosen_ids"])), -float(len(r["rejected_ids"]))
    pad_loss, pad_m, pad_tokens, pad_grads = dpo_loss_and_grads(demo_model, rows, ref, False, loss_impl)
    free_loss, free_m, free_tokens, free_grads = dpo_loss_and_grads(demo_model, rows, ref, True, loss_impl)
    assert free_loss == pytest.approx(pad_loss, abs=1e-5)
    assert free_m.keys() == pad_m.keys()
    for k in pad_m:
        assert free_m[k] == pytest.approx(pad_m[k], abs=1e-4), k
    lengths = [len(r["prompt_ids"]) + len(r[k]) for k in ("chosen_ids", "rejected_ids") for r in rows]
    assert free_tokens == pad_tokens == sum(lengths)
    assert pad_grads.keys() == free_grads.keys()
    for name, g in pad_grads.items():
        torch.testing.assert_close(free_grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
    batch, segments = dpo_padding_free_batch(rows, 0)
    assert batch["input_ids"].shape == (1, sum(lengths)) < (1, len(lengths) * max(lengths))
    assert segments.tolist() == [k for k, n in enumerate(lengths) for _ in range(n)]


def pref_loss_and_grads(demo_model, rows, method, pad_id, padding_free):
    from memfit.train.preference.rm import build_reward_model

    torch.manual_seed(0)
    cand = Candidate.from_dict({"attn": "sdpa", "precision": "fp32", "padding_free": padding_free})
    if method == "rm":  # the score head newly initialised from the seed, as TRL's RewardTrainer makes it
        model = build_reward_model(str(demo_model), pad_id, attn_implementation=attn_implementation(cand))
    else:
        model = load_model(str(demo_model), cand, trainable=True)
    model.train()
    pref = {"simpo": {"cpo_alpha": 0.5}}.get(method)  # SimPO with the chosen NLL term too
    runner = StepRunner(method, model, None, pad_id, pref=pref, padding_free=padding_free)
    loss, metrics, tokens = runner.loss(rows)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), metrics, tokens, grads


@pytest.mark.parametrize("method", ["rm", "orpo", "simpo"])
def test_preference_padding_free_equals_the_padded_batch(demo_model, mixed_dpo_pairs, method):
    """The reward model, ORPO and SimPO on four pairs of mixed lengths as one row of their 8 sequences:
    the loss, every metric and the gradients equal the padded batch's within 1e-5 in fp32. The reward
    is read at each sequence's own last token (the padded batch's pooling reads each row's), ORPO's NLL
    covers each chosen sequence's prompt and response, SimPO's mean log-probs each response's tokens."""
    from transformers import AutoTokenizer

    pad_id = AutoTokenizer.from_pretrained(demo_model).pad_token_id
    rows = mixed_dpo_pairs[0]
    pad_loss, pad_m, pad_tokens, pad_grads = pref_loss_and_grads(demo_model, rows, method, pad_id, False)
    free_loss, free_m, free_tokens, free_grads = pref_loss_and_grads(demo_model, rows, method, pad_id, True)
    assert free_loss == pytest.approx(pad_loss, abs=1e-5)
    assert free_m.keys() == pad_m.keys()
    for k in pad_m:
        assert free_m[k] == pytest.approx(pad_m[k], abs=1e-4), k
    lengths = [len(r["prompt_ids"]) + len(r[k]) for k in ("chosen_ids", "rejected_ids") for r in rows]
    assert free_tokens == pad_tokens == sum(lengths) < len(lengths) * max(lengths)
    assert pad_grads.keys() == free_grads.keys()
    for name, g in pad_grads.items():
        torch.testing.assert_close(free_grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_a_dpo_probe_pads_the_row_to_the_padded_worst_case(mixed_dpo_pairs):
    """pad_to (a probe's seq_len): the row is 2 x rows x seq_len tokens, the padding in no sequence."""
    rows = mixed_dpo_pairs[0]
    batch, segments = dpo_padding_free_batch(rows, 0, pad_to=32)
    assert batch["input_ids"].shape == (1, 2 * len(rows) * 32)
    real = sum(len(r["prompt_ids"]) + len(r[k]) for k in ("chosen_ids", "rejected_ids") for r in rows)
    assert int(segments.lt(2 * len(rows)).sum()) == real


def _run_config(tmp_path, demo_model, demo_data, method, **extra):
    cfg = {
        "method": method,
        "model_path": str(demo_model),
        "data_dir": str(demo_data / method),
        "out_dir": str(tmp_path / "out"),
        "candidate": {"zero": 0, "precision": "fp32", "seq_len": 32, "micro_batch": 2, "ref": "model"},
        **extra,
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize(
    "method, extra, expected",
    [
        ("kto", {"padding_free": True}, "padding_free: applies to sft, dpo, rm, orpo, simpo only"),
        (
            "sft",
            {"padding_free": True, "candidate": {"sequence_parallel": 2, "seq_len": 32, "precision": "fp32"}},
            "padding_free: cannot be combined with sequence_parallel 2",
        ),
    ],
)
def test_padding_free_where_it_does_not_apply_is_refused_at_the_cli(
    tmp_path, demo_model, demo_data, capsys, method, extra, expected
):
    path = _run_config(tmp_path, demo_model, demo_data, method, **extra)
    assert cli.main(["launch", "--config", str(path), "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # nothing half-written


def _flash_missing() -> str | None:
    if not torch.cuda.is_available():
        return "flash-attention's varlen kernel is a CUDA path: this machine has no CUDA GPU"
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "the flash-attn package is not installed"
    return None


@pytest.mark.skipif(_flash_missing() is not None, reason=str(_flash_missing()))
def test_padding_free_under_flash_attention_equals_the_padded_batch(demo_model, sft_rows):
    """On a GPU with flash-attn: the one concatenated row goes through flash-attention's varlen kernel
    (the row's cu_seq_lens and max_length, which memfit passes: StepRunner.row_inputs) and
    its bf16 loss equals the padded batch's within bf16 rounding (1e-2 relative)."""
    rows = mixed_rows(sft_rows)
    cand = Candidate.from_dict({"attn": "flash", "precision": "bf16"})
    model = load_model(str(demo_model), cand, trainable=False).cuda()
    with torch.no_grad():
        padded = float(StepRunner("sft", model, None, 0).loss(rows)[0])
        free = float(StepRunner("sft", model, None, 0, padding_free=True).loss(rows)[0])
    assert free == pytest.approx(padded, rel=1e-2)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["sft", "dpo", "rm"])
def test_a_padding_free_run_trains_like_the_padded_run(demo_model, demo_data, tmp_path, method):
    """Through the trainer (run.json `padding_free: true`, DeepSpeed ZeRO-2, 2 ranks; DPO with its
    reference model; the reward model's score head read per sequence under DeepSpeed's engine): the
    first step's loss equals the padded run's within 1e-5 (the same weights, the same tokens); the
    later steps stay within 1e-4 (fp32 rounding carried through two AdamW steps), and the held-out
    losses agree."""
    import dataclasses

    from deepspeed_runs import base_run, run_side_by_side

    padded = dataclasses.replace(
        base_run(demo_model, demo_data, tmp_path / "padded", method=method), max_steps=3, save_every=0, eval_every=3
    )
    if method == "rm":  # the DPO pairs, as a reward model's data (a prepared rm row is a pair)
        padded = dataclasses.replace(padded, data_dir=str(demo_data / "dpo"))
    free = dataclasses.replace(padded, out_dir=str(tmp_path / "free"), padding_free=True)
    a, b = run_side_by_side(padded, free)
    train_a = [r["loss"] for r in a if r["split"] == "train"]
    train_b = [r["loss"] for r in b if r["split"] == "train"]
    assert len(train_a) == len(train_b) == 3
    assert train_b[0] == pytest.approx(train_a[0], abs=1e-5)
    assert train_b == pytest.approx(train_a, abs=1e-4)
    eval_a = [r["loss"] for r in a if r["split"] == "eval"]
    eval_b = [r["loss"] for r in b if r["split"] == "eval"]
    assert eval_b == pytest.approx(eval_a, abs=1e-4)
    said = "padding_free: each micro batch runs as one row of its rows' tokens"
    assert said in (tmp_path / "free" / "log.txt").read_text()
    assert said not in (tmp_path / "padded" / "log.txt").read_text()
