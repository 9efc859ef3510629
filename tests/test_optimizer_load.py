"""memfit's optimizer-state loader (memfit.train.optimizer_load): what torch's
`Optimizer.load_state_dict` loads, copied into the state that already exists."""

from __future__ import annotations

import copy

import pytest
import torch

from memfit.train.optimizer_load import base_optimizer, in_place_loading, load_state_dict_in_place


def _trained(steps: int, seed: int = 0) -> tuple[list[torch.nn.Parameter], torch.optim.AdamW]:
    gen = torch.Generator().manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(64, 32, generator=gen)),
        torch.nn.Parameter(torch.randn(32, generator=gen)),
    ]
    opt = torch.optim.AdamW(params, lr=1e-2)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return params, opt


def _state(opt: torch.optim.Optimizer) -> list[dict]:
    return [
        {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
        for p in opt.param_groups[0]["params"]
    ]


def _equal(a: list[dict], b: list[dict]) -> bool:
    return all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k] for k in x)
        for x, y in zip(a, b, strict=True)
    )


def test_an_existing_state_is_overwritten_in_place_with_what_torch_loads():
    _, saved_opt = _trained(steps=3)
    saved = saved_opt.state_dict()
    # what torch's own load gives
    _, torch_opt = _trained(steps=1, seed=1)
    torch_opt.load_state_dict(copy.deepcopy(saved))
    # an optimizer whose state exists before the load, as FP16_Optimizer's does at ZeRO-0
    _, opt = _trained(steps=1, seed=1)
    before = {id(p): [t.data_ptr() for t in opt.state[p].values() if torch.is_tensor(t) and t.dim()] for p in opt.state}
    sd = copy.deepcopy(saved)
    assert load_state_dict_in_place(opt, sd) == 6  # step, exp_avg, exp_avg_sq of both params
    after = {id(p): [t.data_ptr() for t in opt.state[p].values() if torch.is_tensor(t) and t.dim()] for p in opt.state}
    assert after == before  # the same storages: no second m and v
    assert sd["state"] == {}  # each loaded tensor dropped once copied
    assert _equal(_state(opt), _state(torch_opt))
    assert opt.param_groups[0]["lr"] == torch_opt.param_groups[0]["lr"]


def test_a_lazy_state_is_placed_as_torch_places_it():
    _, saved_opt = _trained(steps=2)
    saved = saved_opt.state_dict()
    params, fresh = _trained(steps=0, seed=1)
    assert not fresh.state
    assert load_state_dict_in_place(fresh, copy.deepcopy(saved)) == 0
    _, torch_opt = _trained(steps=0, seed=1)
    torch_opt.load_state_dict(copy.deepcopy(saved))
    assert _equal(_state(fresh), _state(torch_opt))


def test_a_checkpoint_of_other_parameter_groups_is_refused():
    _, saved_opt = _trained(steps=1)
    saved = saved_opt.state_dict()
    _, opt = _trained(steps=0)
    saved["param_groups"][0]["params"] = saved["param_groups"][0]["params"][:1]
    with pytest.raises(ValueError, match=r"\[1\] saved, \[2\] now"):
        load_state_dict_in_place(opt, saved)


def test_the_loader_is_installed_only_while_a_checkpoint_loads():
    _, opt = _trained(steps=1)

    class Wrapper:  # how DeepSpeed's ZeRO and 16-bit optimizers hold the base optimizer
        optimizer = opt

    class Engine:
        optimizer = Wrapper()

    assert base_optimizer(Engine.optimizer) is opt
    with in_place_loading(Engine()):
        assert "load_state_dict" in opt.__dict__
    assert (
        "load_state_dict" not in opt.__dict__ and opt.load_state_dict.__func__ is torch.optim.Optimizer.load_state_dict
    )
