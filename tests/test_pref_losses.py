"""rm, ORPO, SimPO and KTO (memfit.train.preference): each method's micro batch, computed by memfit's
StepRunner, equals TRL 1.16's own computation on the same token ids within 1e-5, loss and metrics
under TRL's names; and the loss semantics users set through the hyperparameters.

What runs on TRL's side:
* rm: a real `trl.RewardTrainer` on pre-tokenized pairs (its DataCollatorForPreference, its
  `compute_loss` on a sequence-classification demo model with a score head, its `_metrics`).
* ORPO, SimPO: `ORPOTrainer` / `CPOTrainer(loss_type="simpo")` objects holding only the attributes
  their `get_batch_loss_metrics` reads (building the whole trainer re-tokenizes string prompts
  with its own BOS/EOS rules); their `concatenated_inputs`, `concatenated_forward`,
  `odds_ratio_loss` / `cpo_loss` and metrics run unchanged on TRL-format tensors of memfit's rows.
* KTO: a real `trl.KTOTrainer` with a reference model on unpaired demo rows (conversational);
  memfit runs on the token ids TRL produced, so collation, the KL batch's pairing, masking and
  the loss are compared.

The policy is the demo model with seeded noise on its weights and the reference the unperturbed
model, so log-ratios, margins and accuracies are not trivial.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from memfit.train.losses import IGNORE_INDEX

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

TOL = 1e-5


@pytest.fixture(scope="module")
def pairs(mixed_dpo_pairs):
    """memfit's tokenized rows for four demo pairs of mixed lengths, and their records (conftest)."""
    return mixed_dpo_pairs


def _noisy(model, seed=0, scale=0.02):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def _causal(demo_model, noise: bool):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32, attn_implementation="sdpa")
    return _noisy(m) if noise else m


def _pad_id(demo_model) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model).pad_token_id


def _runner(method, engine, ref, pad_id, pref, ref_mode="model"):
    from memfit.train.steps import StepRunner

    return StepRunner(method, engine, ref, pad_id, ref=ref_mode, pref=pref)


def _means(method, runner, rows):
    from memfit.train import preference

    with torch.no_grad():
        loss, sums, _ = runner.loss(rows)
    return float(loss), preference.finish_metrics(method, {k: v / len(rows) for k, v in sums.items()})


# -- rm ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("margin,center", [(False, None), (True, 0.01)])
def test_rm_matches_trl_reward_trainer(demo_model, pairs, tmp_path, margin, center):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    from memfit.train.preference.rm import build_reward_model

    rows, _ = pairs
    if margin:  # the Llama-2 margin: one per pair, mixed
        rows = [r | {"margin": m} for r, m in zip(rows, (0.0, 0.5, 1.0, 0.25), strict=True)]
    tok = AutoTokenizer.from_pretrained(demo_model)
    torch.manual_seed(0)
    model = _noisy(build_reward_model(demo_model, tok.pad_token_id, attn_implementation="sdpa"))
    records = [
        {
            "chosen_ids": list(r["prompt_ids"]) + list(r["chosen_ids"]),
            "rejected_ids": list(r["prompt_ids"]) + list(r["rejected_ids"]),
        }
        | ({"margin": r["margin"]} if margin else {})
        for r in rows
    ]
    args = RewardConfig(
        output_dir=str(tmp_path),
        report_to=[],
        center_rewards_coefficient=center,
        max_length=None,
        per_device_train_batch_size=len(rows),
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        logging_strategy="no",
        save_strategy="no",
    )
    trainer = RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(records), processing_class=tok)
    model.train()
    batch = trainer.data_collator([dict(ex) for ex in trainer.train_dataset])
    with torch.no_grad():
        trl_loss = float(trainer.compute_loss(model, batch))
    trl_m = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    loss, m = _means("rm", _runner("rm", model, None, tok.pad_token_id, {"center_rewards_coefficient": center}), rows)
    assert loss == pytest.approx(trl_loss, abs=TOL, rel=0)
    assert m["loss"] == pytest.approx(trl_loss, abs=TOL, rel=0)
    for k in ("accuracy", "margin", "mean_reward"):
        assert m[k] == pytest.approx(trl_m[k], abs=TOL, rel=0), k
    assert abs(trl_m["margin"]) > 1e-4  # the score head tells chosen from rejected apart


# -- ORPO and SimPO: TRL's trainer methods on TRL-format tensors of the same rows ----------------
def _trl_pair_batch(rows, pad_id) -> dict[str, torch.Tensor]:
    """The tensors TRL's DPODataCollatorWithPadding makes (chosen_*/rejected_*, right padding)."""
    from memfit.train.batches import _pad

    out = {}
    for side in ("chosen", "rejected"):
        ids = [list(r["prompt_ids"]) + list(r[f"{side}_ids"]) for r in rows]
        labels = [[IGNORE_INDEX] * len(r["prompt_ids"]) + list(r[f"{side}_ids"]) for r in rows]
        out[f"{side}_input_ids"] = _pad(ids, pad_id)
        out[f"{side}_attention_mask"] = _pad([[1] * len(s) for s in ids], 0)
        out[f"{side}_labels"] = _pad(labels, IGNORE_INDEX)
    return out


def _bare_trainer(cls, pad_id, **attrs):
    """A TRL trainer object with only what `get_batch_loss_metrics` reads (single process)."""
    trainer = object.__new__(cls)
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda t: t)
    vars(trainer).update(
        is_encoder_decoder=False,
        padding_value=pad_id,
        pad_token_id=pad_id,
        aux_loss_enabled=False,
        accelerator=accelerator,
        **attrs,
    )
    return trainer


PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "nll_loss",
)


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_orpo_matches_trl(demo_model, pairs, beta):
    from trl.experimental.orpo import ORPOTrainer

    rows, _ = pairs
    pad_id = _pad_id(demo_model)
    policy = _causal(demo_model, noise=True)
    trainer = _bare_trainer(ORPOTrainer, pad_id, beta=beta)
    with torch.no_grad():
        trl_loss, trl_m = trainer.get_batch_loss_metrics(policy, _trl_pair_batch(rows, pad_id))
    loss, m = _means("orpo", _runner("orpo", policy, None, pad_id, {"beta": beta}), rows)
    assert loss == pytest.approx(float(trl_loss), abs=TOL, rel=0)
    for k in (*PAIR_METRICS, "log_odds_ratio", "log_odds_chosen"):
        assert m[k] == pytest.approx(trl_m[k], abs=TOL, rel=0), k
    assert m["nll_loss"] > 0 and abs(m["rewards/margins"]) > 1e-4


@pytest.mark.parametrize(
    "cfg",
    [
        {"beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.0, "label_smoothing": 0.0},
        {"beta": 0.1, "simpo_gamma": 0.5, "cpo_alpha": 1.0, "label_smoothing": 0.1},
    ],
)
def test_simpo_matches_trl_cpo_simpo(demo_model, pairs, cfg):
    from trl.experimental.cpo import CPOTrainer

    rows, _ = pairs
    pad_id = _pad_id(demo_model)
    policy = _causal(demo_model, noise=True)
    trainer = _bare_trainer(CPOTrainer, pad_id, loss_type="simpo", alpha=0.0, **cfg)
    with torch.no_grad():
        trl_loss, trl_m = trainer.get_batch_loss_metrics(policy, _trl_pair_batch(rows, pad_id))
    loss, m = _means("simpo", _runner("simpo", policy, None, pad_id, cfg), rows)
    assert loss == pytest.approx(float(trl_loss), abs=TOL, rel=0)
    for k in PAIR_METRICS:
        assert m[k] == pytest.approx(trl_m[k], abs=TOL, rel=0), k
    assert abs(m["rewards/margins"]) > 1e-4


# -- KTO: a real KTOTrainer ---------------------------------------------------------------------
def _kto_trainer(demo_model, records, policy, ref, tmp_path, cfg):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    tok = AutoTokenizer.from_pretrained(demo_model)
    unpaired = []
    for i, r in enumerate(records):  # unequal kinds: every pair's chosen, every other pair's rejected
        prompt = [{"role": "user", "content": r["prompt"]}]
        unpaired.append(
            {"prompt": prompt, "completion": [{"role": "assistant", "content": r["chosen"]}], "label": True}
        )
        if i % 2 == 0:
            unpaired.append(
                {"prompt": prompt, "completion": [{"role": "assistant", "content": r["rejected"]}], "label": False}
            )
    args = KTOConfig(
        output_dir=str(tmp_path),
        report_to=[],
        per_device_train_batch_size=len(unpaired),
        max_length=None,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        logging_strategy="no",
        save_strategy="no",
        **cfg,
    )
    return KTOTrainer(
        model=policy, ref_model=ref, args=args, train_dataset=Dataset.from_list(unpaired), processing_class=tok
    )


@pytest.mark.parametrize(
    "cfg,seed", [({"beta": 0.1}, 0), ({"beta": 0.5, "desirable_weight": 1.5, "undesirable_weight": 0.8}, 3)]
)
def test_kto_matches_trl_kto_trainer(demo_model, pairs, tmp_path, cfg, seed):
    _, records = pairs
    ref = _causal(demo_model, noise=False)
    policy = _noisy(_causal(demo_model, noise=False), seed=seed)
    trainer = _kto_trainer(demo_model, records, policy, ref, tmp_path, cfg)
    examples = [dict(ex) for ex in trainer.train_dataset]
    policy.train()
    trainer._metrics["train"].clear()
    with torch.no_grad():
        trl_loss = float(trainer.compute_loss(trainer.model, trainer.data_collator(examples)))
    trl_m = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    rows = [{k: ex[k] for k in ("prompt_ids", "completion_ids", "label")} for ex in examples]
    from memfit.train.preference.kto import kl_completions

    assert kl_completions(rows) == [list(ex["KL_completion_ids"]) for ex in examples]  # TRL's pairing
    assert {r["label"] for r in rows} == {True, False}
    loss, m = _means("kto", _runner("kto", policy, ref, trainer.processing_class.pad_token_id, cfg), rows)
    assert loss == pytest.approx(trl_loss, abs=TOL, rel=0)
    for k in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert m[k] == pytest.approx(trl_m[k], abs=TOL, rel=0), k
    assert abs(m["rewards/margins"]) > 1e-4


# -- semantics users set through the hyperparameters ----------------------------------------------
def test_rm_margin_and_centering_are_the_papers_terms():
    from memfit.train.preference.rm import RMConfig, rm_loss

    c, r, m = torch.tensor([1.0, -0.5]), torch.tensor([0.2, 0.5]), torch.tensor([0.3, 0.0])
    plain, metrics = rm_loss(c, r, RMConfig())
    assert torch.allclose(plain, -torch.nn.functional.logsigmoid(c - r))
    assert metrics["accuracy"].tolist() == [1.0, 0.0] and torch.allclose(metrics["margin"], c - r)
    # a margin asks the chosen reward to beat the rejected one by that much: a larger loss
    with_margin, _ = rm_loss(c, r, RMConfig(), m)
    assert with_margin[0] > plain[0] and with_margin[1] == plain[1]
    centered, _ = rm_loss(c, r, RMConfig(center_rewards_coefficient=0.01), m)
    assert torch.allclose(centered, with_margin + 0.01 * (c + r) ** 2)


def test_orpo_log_odds_use_log1mexp_and_simpo_margin_is_gamma():
    from memfit.train.preference.orpo import ORPOConfig, orpo_loss
    from memfit.train.preference.simpo import SimPOConfig, simpo_loss

    c, r, nll = torch.tensor([-0.4, -2.0]), torch.tensor([-1.0, -0.3]), torch.tensor(1.5)
    losses, m = orpo_loss(c, r, nll, ORPOConfig(beta=0.2))
    odds = lambda lp: math.log(math.exp(lp) / (1 - math.exp(lp)))  # noqa: E731 - Eq. 4's odds, directly
    for i in range(2):
        lor = odds(float(c[i])) - odds(float(r[i]))
        assert float(m["log_odds_chosen"][i]) == pytest.approx(lor, rel=1e-5)
        assert float(losses[i]) == pytest.approx(1.5 - 0.2 * math.log(1 / (1 + math.exp(-lor))), rel=1e-5)
    # SimPO Eq. 6: -log sigma(beta * (c - r) - gamma); at c - r = gamma / beta it is log 2
    s, _ = simpo_loss(torch.tensor([-1.0]), torch.tensor([-1.25]), nll, SimPOConfig(beta=2.0, simpo_gamma=0.5))
    assert float(s[0]) == pytest.approx(math.log(2), rel=1e-6)
    with_nll, m = simpo_loss(
        torch.tensor([-1.0]), torch.tensor([-1.25]), nll, SimPOConfig(beta=2.0, simpo_gamma=0.5, cpo_alpha=0.5)
    )
    assert float(with_nll[0]) == pytest.approx(math.log(2) + 0.75, rel=1e-6) and float(m["nll_loss"][0]) == 1.5


def test_kto_reference_point_is_clamped_and_kinds_are_weighted():
    from memfit.train.preference.kto import KTOConfig, finish_metrics, kto_loss, reference_point

    assert float(reference_point(torch.tensor([-3.0, -2.0]), torch.tensor([-2.0, -1.5]))) == 0.0  # negative: 0
    assert float(reference_point(torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -2.0]))) == pytest.approx(0.5)
    policy, ref = torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-1.5, -1.5, -3.0])
    desirable = torch.tensor([True, False, True])
    cfg = KTOConfig(beta=0.5, desirable_weight=2.0, undesirable_weight=0.5)
    losses, m = kto_loss(policy, ref, desirable, torch.tensor(0.2), cfg)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert losses.tolist() == pytest.approx(
        [2.0 * (1 - sig(0.5 * (0.5 - 0.2))), 0.5 * (1 - sig(0.5 * (0.2 + 0.5))), 2.0 * (1 - sig(-0.1))]
    )
    means = finish_metrics({k: float(v.sum()) / 3 for k, v in m.items()})
    assert means["rewards/chosen"] == pytest.approx((0.25 + 0.0) / 2)  # over the 2 desirable rows only
    assert means["rewards/rejected"] == pytest.approx(-0.25)
    assert means["rewards/margins"] == pytest.approx(0.125 + 0.25)
    assert not any(k.endswith("_sum") or k.startswith("count/") for k in means)


@pytest.mark.parametrize(
    "method,values,message",
    [
        ("orpo", {"alpha": 0.1}, "orpo: unknown hyperparameter 'alpha' (known: beta)"),
        ("simpo", {"beta": 0}, "simpo beta must be > 0"),
        ("simpo", {"label_smoothing": 0.5}, "simpo label_smoothing must be in [0, 0.5)"),
        ("kto", {"undesirable_weight": -1}, "kto undesirable_weight must be > 0"),
        ("rm", {"center_rewards_coefficient": -0.01}, "rm center_rewards_coefficient must be >= 0"),
    ],
)
def test_bad_hyperparameters_name_the_key(method, values, message):
    from memfit.train import preference

    with pytest.raises(ValueError) as err:
        preference.make_config(method, values)
    assert str(err.value).startswith(message)
