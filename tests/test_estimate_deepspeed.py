"""The estimator against real 2-rank DeepSpeed training steps (gloo, fp32, CPU).

Each case runs `memfit.probe.run_probe` exactly as the workflow's probe rule does (the demo
Llama `config/models/demo-tiny.json`, seq_len 24, 32 sequences per optimizer step, peak
allocated bytes of live tensor storages per rank via `memory.AllocationTracker`) and compares
`estimate(..., budget_bytes=...)`'s allocated peak with it. Tolerance: 10% (measured on
2026-11: z0 DPO grad_accum 2 1.017, z2 SFT 0.963, z3 SFT 1.003; also z0 DPO grad_accum 4
1.010, z2 DPO 1.049, z3 SFT grad_accum 4 0.991).

Not covered within 10%: ZeRO-3 with gradient checkpointing and DPO ref=precomputed (measured
63.1 MiB, predicted 47.1, ratio 1.34). Two causes seen in an allocation trace: the ranks'
baseline holds 5.7 MiB (4 P / N) more than without the precompute pass (the reference
pass's ZeRO-3 partitions stay referenced after `Run._precompute_reference`), and ZeRO-3's
`LinearFunctionForZeroStage3` (runtime/zero/linear.py) saves more per layer under
checkpointing than the estimator's recompute term. It is left out here rather than
asserted loosely.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from memfit import catalog
from memfit.estimate import estimate
from memfit.space import Candidate

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CASES = {
    # ZeRO-0 at grad_accum 2: param.grad lives across micro steps (engine.py step boundary)
    "z0-dpo-mb8": ("dpo", dict(zero=0, micro_batch=8, ref="precomputed")),
    "z2-sft-mb16": ("sft", dict(zero=2, micro_batch=16)),
    # ZeRO-3: full-size gradients held until reduce-scatter (stage3.py)
    "z3-sft-mb16": ("sft", dict(zero=3, micro_batch=16)),
}


def _cand(kw: dict) -> Candidate:
    c = dict(
        attn="sdpa", seq_len=24, precision="fp32", finetune="full", grad_ckpt=False, ref="model"
    )
    c.update(kw)
    c["grad_accum"] = 32 // (c["micro_batch"] * 2)
    return Candidate(**c)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from memfit import demo
    from memfit.data import prepare

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    root = tmp_path_factory.mktemp("ds-gt")
    model = root / "model"
    demo.main(
        [
            "model",
            "--config",
            str(REPO / "config/models/demo-tiny.json"),
            "--data",
            str(REPO / "data/demo"),
            "--out",
            str(model),
        ]
    )
    for m in ("sft", "dpo"):
        prepare(
            m,
            str(REPO / f"data/demo/{m}.jsonl"),
            str(model),
            str(root / m),
            max_len=24,
            eval_fraction=0.05,
        )
    return root


@pytest.fixture(scope="module")
def measured(built):
    from memfit.probe import run_probe
    from memfit.train import RunConfig

    out = {}
    for name, (method, kw) in CASES.items():
        res = run_probe(
            RunConfig(
                method=method,
                model_path=str(built / "model"),
                data_dir=str(built / method),
                out_dir=str(built / "out"),
                candidate=_cand(kw).to_dict(),
                dpo={"beta": 0.1} if method == "dpo" else {},
            ),
            nproc=2,
            out_json=built / f"{name}.json",
            log=built / f"{name}.log",
            steps=3,
        )
        assert res["status"] == "ok", res
        out[name] = res["peak_allocated_bytes"]
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_prediction_within_10_percent(built, measured, name):
    method, kw = CASES[name]
    arch = catalog.model(str(built / "model"))
    e = estimate(arch, catalog.gpu("cpu"), 2, 1, method, _cand(kw), budget_bytes=8 * 2**30)
    ratio = measured[name] / e.peak_allocated_bytes
    assert 0.90 <= ratio <= 1.10, (name, measured[name], e.peak_allocated_bytes, e.phases)
