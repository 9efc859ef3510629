"""The preference methods beside DPO: reward-model training (`rm`), ORPO, SimPO and KTO.

One module per method (`rm`, `orpo`, `simpo`, `kto`), each with its loss (citing its paper's
equation, compared with TRL 1.16 in tests/test_pref_losses.py and tests/test_pref_steps.py), its
hyperparameters under TRL's names (a frozen dataclass) and `step`, one micro batch's forward and
loss as `memfit.train.steps.StepRunner.loss` returns it; `pairs` holds the policy-only pair
forward ORPO and SimPO share. `StepRunner` dispatches here (`make_config`, `step`); the loop turns
the averaged sums into the logged metrics with `finish_metrics`.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from memfit.train.preference import kto, orpo, rm, simpo

METHODS = ("rm", "orpo", "simpo", "kto")
_MODULES = {"rm": rm, "orpo": orpo, "simpo": simpo, "kto": kto}
_CONFIGS = {"rm": rm.RMConfig, "orpo": orpo.ORPOConfig, "simpo": simpo.SimPOConfig, "kto": kto.KTOConfig}


def make_config(method: str, values: dict[str, Any] | None = None):
    """The method's hyperparameters from a dict of TRL-named values (None: the defaults); an
    unknown key or a value out of range raises ValueError naming it."""
    if method not in _CONFIGS:
        raise ValueError(f"unknown preference method {method!r}; one of {', '.join(METHODS)}")
    cls = _CONFIGS[method]
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(values or {}) - set(known))
    if unknown:
        raise ValueError(f"{method}: unknown hyperparameter {unknown[0]!r} (known: {', '.join(known)})")
    return cls(**(values or {}))


def hyperparameters(method: str) -> tuple[str, ...]:
    """The TRL-named hyperparameters `method`'s `train.<method>` section may carry (its config's fields)."""
    return tuple(f.name for f in fields(_CONFIGS[method])) if method in _CONFIGS else ()


def step(runner, rows: list[dict[str, Any]], pad_to: int | None):
    """`runner.method`'s micro batch: (mean loss, summed metrics, non-padding tokens)."""
    if runner.shard is not None:
        raise ValueError(f"{runner.method} does not run under sequence parallelism (sequence_parallel: 1)")
    return _MODULES[runner.method].step(runner, rows, pad_to)


def finish_metrics(method: str, means: dict[str, float]) -> dict[str, float]:
    """The logged metrics from the row means of the summed metrics (KTO's per-kind means; the
    others' are already TRL's)."""
    return kto.finish_metrics(means) if method == "kto" else means
