"""The micro-batch steps of rm, ORPO, SimPO and KTO train: a few optimizer steps on the demo model
lower each method's loss, a reward model learns a trivially separable preference (held-out
accuracy above 0.9), and the variants a run can pick (the chunked vocabulary loss, KTO's reference
as a model, as the policy's disabled adapter, or precomputed) compute the same loss."""

from __future__ import annotations

import copy

import pytest
import torch

from memfit.train import preference
from memfit.train.steps import StepRunner


@pytest.fixture(scope="module")
def pair_rows(demo_model, repo, tmp_path_factory):
    from memfit import data

    out = tmp_path_factory.mktemp("pref_steps")
    data.prepare("dpo", repo / "data/demo/dpo.jsonl", demo_model, out, max_len=24, eval_fraction=0.05)
    return data.load_split(out, "train")


@pytest.fixture(scope="module")
def tok(demo_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model)


def _causal(demo_model):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32, attn_implementation="sdpa")


def _unpaired(pairs, drop_rejected_every: int = 3):
    """KTO rows from pairs: each chosen desirable, most rejected undesirable (unequal kinds)."""
    rows = []
    for i, r in enumerate(pairs):
        rows.append({"prompt_ids": r["prompt_ids"], "completion_ids": r["chosen_ids"], "label": True})
        if i % drop_rejected_every:
            rows.append({"prompt_ids": r["prompt_ids"], "completion_ids": r["rejected_ids"], "label": False})
    return rows


def _train(runner, model, rows, steps: int, lr: float) -> list[float]:
    """`steps` AdamW steps on the same micro batch; the loss before each step."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        loss, _, _ = runner.loss(rows)
        losses.append(float(loss))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses


@pytest.mark.parametrize("method", ["orpo", "simpo", "kto"])
def test_a_few_steps_lower_the_loss(demo_model, pair_rows, tok, method):
    model = _causal(demo_model)
    ref = copy.deepcopy(model).eval().requires_grad_(False) if method == "kto" else None
    rows = _unpaired(pair_rows[:4]) if method == "kto" else pair_rows[:4]
    pref = {"beta": 2.0, "simpo_gamma": 0.5} if method == "simpo" else {"beta": 0.5} if method == "kto" else None
    runner = StepRunner(method, model, ref, tok.pad_token_id, ref="model", pref=pref)
    losses = _train(runner, model, rows, steps=4, lr=1e-3)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 1e-3, losses


def _separable(pairs, tok) -> list[dict]:
    """Toy pairs a reward model can tell apart from the response alone: chosen always says one
    thing, rejected another, after the demo prompts."""
    good = tok("right answer", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    bad = tok("wrong answer", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert good != bad
    return [{"prompt_ids": r["prompt_ids"], "chosen_ids": good, "rejected_ids": bad} for r in pairs]


def test_reward_model_learns_a_separable_preference(demo_model, pair_rows, tok):
    from memfit.train.preference.rm import build_reward_model

    torch.manual_seed(0)
    model = build_reward_model(demo_model, tok.pad_token_id, attn_implementation="sdpa")
    with torch.no_grad():  # every reward equal at the start: no pair is told apart yet (ties are wrong)
        model.score.weight.zero_()
    toy = _separable(pair_rows[:28], tok)
    train, held_out = toy[:16], toy[16:]
    runner = StepRunner("rm", model, None, tok.pad_token_id, pref={"center_rewards_coefficient": 0.01})

    def held_out_eval() -> tuple[float, float]:
        model.eval()
        with torch.no_grad():
            loss, sums, _ = runner.loss(held_out)
        return sums["accuracy"] / len(held_out), float(loss)

    accuracy, loss = held_out_eval()
    assert accuracy == 0.0 and loss == pytest.approx(0.6931, abs=1e-3)  # log 2: all rewards equal
    _train(runner, model, train, steps=4, lr=1e-3)
    accuracy, loss = held_out_eval()
    assert accuracy > 0.9 and loss < 0.68  # below log 2: the held-out pairs are told apart


@pytest.mark.parametrize("method", ["orpo", "simpo", "kto"])
def test_chunked_vocabulary_loss_equals_the_full_one(demo_model, pair_rows, tok, method):
    """`loss_impl: chunked` (the full logits never exist) gives the same loss and metrics."""
    model = _causal(demo_model)
    ref = copy.deepcopy(model).eval() if method == "kto" else None
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    rows = _unpaired(pair_rows[:4]) if method == "kto" else pair_rows[:4]
    out = {}
    for impl in ("full", "chunked"):
        runner = StepRunner(method, model, ref, tok.pad_token_id, ref="model", loss_impl=impl, loss_chunk_tokens=7)
        with torch.no_grad():
            loss, sums, tokens = runner.loss(rows)
        out[impl] = (float(loss), sums, tokens)
    assert out["chunked"][0] == pytest.approx(out["full"][0], abs=1e-5)
    assert out["chunked"][2] == out["full"][2]
    for k, v in out["full"][1].items():
        assert out["chunked"][1][k] == pytest.approx(v, abs=1e-4), k


class _Engine(torch.nn.Module):
    """What a DeepSpeed engine shows the step: callable, the model as `.module`."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, **kwargs):
        return self.module(**kwargs)


def test_kto_reference_as_model_adapter_or_precomputed_agree(demo_model, pair_rows, tok):
    """The three reference modes of a run give one KTO loss; precomputed needs a fixed KL pairing."""
    from peft import LoraConfig, get_peft_model

    base = _causal(demo_model)
    ref = copy.deepcopy(base).eval()
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # a trained adapter: lora_B starts at zero
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.05)
    rows = _unpaired(pair_rows[:5])
    rows = [r | {"kl_completion_ids": rows[(i + 2) % len(rows)]["completion_ids"]} for i, r in enumerate(rows)]
    pad = tok.pad_token_id

    def run(mode, engine, reference, batch):
        with torch.no_grad():
            loss, sums, _ = StepRunner("kto", engine, reference, pad, ref=mode).loss(batch)
        return float(loss), preference.finish_metrics("kto", {k: v / len(batch) for k, v in sums.items()})

    as_model = run("model", policy, ref, rows)
    as_adapter = run("adapter", _Engine(policy), None, rows)
    # precomputed: the reference's summed log-probs of each row and of its fixed KL row
    runner = StepRunner("kto", ref, None, pad)
    from memfit.train.preference import kto

    batch = kto.collate(rows, pad)
    with torch.no_grad():
        ref_lp = kto._sequence_logps(runner, ref, batch, "").tolist()
        ref_kl = kto._sequence_logps(runner, ref, batch, "kl_").tolist()
    pre = [r | {"ref_logps": a, "ref_KL_logps": b} for r, a, b in zip(rows, ref_lp, ref_kl, strict=True)]
    as_precomputed = run("precomputed", policy, None, pre)
    for other in (as_adapter, as_precomputed):
        assert other[0] == pytest.approx(as_model[0], abs=1e-5)
        for k in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert other[1][k] == pytest.approx(as_model[1][k], abs=1e-5), k
    assert abs(as_model[1]["rewards/margins"]) > 1e-4  # the adapter moved the policy

    no_pairing = [{k: v for k, v in r.items() if k != "kl_completion_ids"} for r in pre]
    with pytest.raises(ValueError, match="kto with ref: precomputed needs rows with kl_completion_ids"):
        run("precomputed", policy, None, no_pairing)


def test_kto_rows_must_say_desirable_or_not(demo_model, pair_rows, tok):
    model = _causal(demo_model)
    rows = _unpaired(pair_rows[:2])
    rows[1] = rows[1] | {"label": "good"}
    with pytest.raises(
        ValueError, match="kto: a row's label must be true .desirable. or false .undesirable., got 'good'"
    ):
        StepRunner("kto", model, model, tok.pad_token_id).loss(rows)
