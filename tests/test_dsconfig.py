"""memfit.dsconfig: the DeepSpeed JSON every probe and training run uses."""

import pytest
import torch
from deepspeed.runtime.lr_schedules import WarmupCosineLR

from memfit import dsconfig
from memfit.space import Candidate


def _lrs(warmup_steps: int, steps: int = 4) -> list[float]:
    """The learning rates DeepSpeed's own scheduler yields for the config memfit writes."""
    cfg = dsconfig.build(Candidate(zero=2, micro_batch=1), world_size=1, lr=1.0, total_steps=10, warmup_steps=warmup_steps)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = WarmupCosineLR(opt, **cfg["scheduler"]["params"])
    sched.step()  # as memfit.train does after deepspeed.initialize
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_no_warmup_starts_at_the_peak_learning_rate():
    # DeepSpeed refuses warmup_num_steps=0, which a 1-step run (warmup capped at half the run) hit
    lrs = _lrs(0)
    assert lrs[0] == pytest.approx(1.0) and lrs[1] == pytest.approx(1.0)
    assert lrs[3] < lrs[2] < 1.0  # then the cosine decay


def test_linear_warmup_ramps_from_zero():
    # as transformers' get_cosine_schedule_with_warmup: the first step at 0, then up linearly;
    # DeepSpeed's cosine decay begins right after the warmup (lr_schedules.py get_lr_ratio)
    lrs = _lrs(2)
    assert lrs[:2] == pytest.approx([0.0, 0.5]) and 0.9 < lrs[2] < 1.0
