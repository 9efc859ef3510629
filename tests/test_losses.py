"""Loss semantics users rely on: HF's SFT loss, and the DPO family as TRL defines it."""

import math

import pytest
import torch
import torch.nn.functional as F

from memfit.train.losses import IGNORE_INDEX, DPOConfig, dpo_loss, sequence_logps, sft_loss


def test_sft_loss_equals_the_hf_models_own_loss(demo_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_model)
    torch.manual_seed(0)
    ids = torch.randint(3, 100, (3, 12))
    labels = ids.clone()
    labels[:, :5] = IGNORE_INDEX  # the prompt
    labels[2, 9:] = IGNORE_INDEX  # padding
    out = model(input_ids=ids, labels=labels)
    ours, n = sft_loss(out.logits, labels)
    assert n == 7 + 7 + 4  # labels 5..11 (row 2: 5..8); position t predicts token t+1
    assert float(ours) == pytest.approx(float(out.loss), rel=1e-6)


def test_sequence_logps_sum_response_tokens_only():
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 3, 4, 1], [IGNORE_INDEX, 2, 2, IGNORE_INDEX, IGNORE_INDEX]])
    total, n = sequence_logps(logits, labels)
    lp = logits.log_softmax(-1)
    assert n.tolist() == [3, 2]
    assert float(total[0]) == pytest.approx(float(lp[0, 1, 3] + lp[0, 2, 4] + lp[0, 3, 1]), rel=1e-6)
    assert float(total[1]) == pytest.approx(float(lp[1, 0, 2] + lp[1, 1, 2]), rel=1e-6)


PC, PR, RC, RR = (torch.tensor(v) for v in ([-5.0, -7.0], [-6.0, -5.5], [-5.5, -7.2], [-5.8, -6.0]))


def test_sigmoid_dpo_is_eq7_and_rewards_are_beta_log_ratios():
    losses, m = dpo_loss(PC, PR, RC, RR, DPOConfig(beta=0.1))
    h = (PC - PR) - (RC - RR)
    assert torch.allclose(losses, -F.logsigmoid(0.1 * h))
    assert torch.allclose(m["rewards/chosen"], 0.1 * (PC - RC))
    assert torch.allclose(m["rewards/margins"], 0.1 * (PC - RC) - 0.1 * (PR - RR))
    assert m["rewards/accuracies"].tolist() == [1.0, 0.0]


def test_policy_equal_to_reference_gives_log2():
    losses, m = dpo_loss(PC, PR, PC, PR, DPOConfig(beta=0.5))
    assert torch.allclose(losses, torch.full((2,), math.log(2)))
    assert m["rewards/accuracies"].sum() == 0  # ties do not count as correct (TRL: chosen > rejected)


def test_cdpo_label_smoothing_and_hinge_and_ipo():
    h = (PC - PR) - (RC - RR)
    cdpo, _ = dpo_loss(PC, PR, RC, RR, DPOConfig(beta=0.1, label_smoothing=0.2))
    assert torch.allclose(cdpo, -0.8 * F.logsigmoid(0.1 * h) - 0.2 * F.logsigmoid(-0.1 * h))
    hinge, _ = dpo_loss(PC, PR, RC, RR, DPOConfig(beta=0.1, loss_type="hinge"))
    assert torch.allclose(hinge, torch.relu(1 - 0.1 * h))
    lc, lr = torch.tensor([4, 2]), torch.tensor([5, 3])
    ipo, _ = dpo_loss(PC, PR, RC, RR, DPOConfig(beta=0.1, loss_type="ipo"), lc, lr)
    hn = (PC - RC) / lc - (PR - RR) / lr
    assert torch.allclose(ipo, (hn - 1 / 0.2) ** 2)
    with pytest.raises(ValueError, match="ipo loss needs"):
        dpo_loss(PC, PR, RC, RR, DPOConfig(loss_type="ipo"))
    with pytest.raises(ValueError, match="sigmoid, ipo or hinge"):
        DPOConfig(loss_type="kto")
