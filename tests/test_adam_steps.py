"""A resumed DeepSpeed CPU Adam (FusedAdam on the CPU accelerator, DeepSpeedCPUAdam for offload)
continues bit for bit as if it had never stopped (memfit.train.adam_steps)."""

from __future__ import annotations

import copy

import pytest
import torch

from memfit.train.adam_steps import cpu_adam_of, replay_adam_steps, saved_steps


def _make(kind: str, param: torch.nn.Parameter):
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    betas = (0.9, 0.95)  # memfit's dsconfig betas
    if kind == "fused":
        return FusedAdam([param], lr=3e-3, betas=betas, adam_w_mode=True)
    return DeepSpeedCPUAdam([param], lr=3e-3, betas=betas, adamw_mode=True)


@pytest.mark.parametrize("kind", ["fused", "cpu_adam"])
def test_resumed_cpu_adam_matches_the_uninterrupted_run_bit_for_bit(kind):
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(4096, generator=gen)
    grads = [torch.randn(4096, generator=gen) for _ in range(10)]

    param = torch.nn.Parameter(start.clone())
    opt = _make(kind, param)
    for i, grad in enumerate(grads):
        param.grad = grad.clone()
        opt.step()
        if i == 5:  # a checkpoint after step 6
            saved = (param.detach().clone(), copy.deepcopy(opt.state_dict()))

    def resumed(replay: bool) -> torch.Tensor:
        p = torch.nn.Parameter(saved[0].clone())
        o = _make(kind, p)
        o.load_state_dict(copy.deepcopy(saved[1]))
        assert saved_steps(o) == 6
        if replay:
            assert replay_adam_steps(o) == 6
        for grad in grads[6:]:
            p.grad = grad.clone()
            o.step()
        return p.detach()

    assert torch.equal(resumed(replay=True), param.detach())
    # what memfit fixes: a fresh kernel object computes beta^7 with pow(), the uninterrupted
    # one by seven multiplications, and the updates part in the last bits
    assert not torch.equal(resumed(replay=False), param.detach())


def test_only_cpu_kernels_are_replayed():
    from deepspeed.ops.adam import FusedAdam

    p = torch.nn.Parameter(torch.zeros(4))
    fused = FusedAdam([p])

    class Wrapper:  # how ZeRO and the 16-bit optimizers hold the base optimizer
        optimizer = fused

    assert cpu_adam_of(Wrapper()) is fused  # DS_ACCELERATOR=cpu (tests/conftest.py)
    assert cpu_adam_of(torch.optim.AdamW([p])) is None
    assert replay_adam_steps(torch.optim.AdamW([p])) == 0
