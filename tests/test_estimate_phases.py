"""Phases and the peak's breakdown (memfit.estimate.phases): the breakdown accounts for every
byte of the peak, and the peak is the largest phase."""

from __future__ import annotations

import pytest

from memfit import catalog
from memfit.estimate import DEFAULT_SETTINGS, estimate_space
from memfit.space import enumerate_space

AXES = {
    "zero": [0, 1, 2, 3],
    "grad_ckpt": [False, True],
    "attn": ["sdpa", "eager"],
    "finetune": ["full", "lora", "qlora"],
    "grad_accum": [1, 4],
    "seq_len": [512, 4096],
}


@pytest.mark.parametrize(
    "model,gpu,method",
    [
        ("llama-3.1-8b", "a100-80gb", "sft"),
        ("glm-4-9b", "h100-80gb", "dpo"),
        ("gemma-3-4b", "rtx4090", "dpo"),
    ],
)
def test_breakdown_sums_to_the_peak_and_the_peak_is_the_largest_phase(model, gpu, method):
    cands = list(enumerate_space(AXES, {"ref": "model" if method == "dpo" else "precomputed"}))
    rows = estimate_space(
        catalog.model(model), catalog.gpu(gpu), 4, 1, method, cands, settings=DEFAULT_SETTINGS
    )
    phases_seen = set()
    for row in rows:
        if row["invalid"]:
            continue
        parts = row["breakdown"]
        assert sum(parts.values()) == row["device_total_bytes"], row["id"]
        assert row["device_total_bytes"] - parts["overheads"] == row["peak_allocated_bytes"], row[
            "id"
        ]
        assert all(v >= 0 for v in parts.values()), (row["id"], parts)
        assert (
            row["phases"][row["peak_phase"]]
            == max(row["phases"].values())
            == row["peak_allocated_bytes"]
        )
        phases_seen.add(row["peak_phase"])
    # the space is varied enough that the peak is not always in the same phase
    assert len(phases_seen) >= 2, phases_seen
