"""The compile lever (run config `compile: true`, docs/speed.md): regional torch.compile of the decoder
layers (memfit.train.compile) trains the same as eager under DeepSpeed ZeRO-0 and ZeRO-3 on 2 ranks,
on the CPU through inductor's C++ backend.

Tolerance: inductor fuses the layer's elementwise ops (RMSNorm, SiLU x up, RoPE, residual adds) and
may reorder the reductions inside them, so each forward differs from eager by float32 rounding
(~1e-6 relative per op). Over 3 optimizer steps at lr 3e-3 those differences grow through the
weights; the losses of the demo model (about 5.7) agree within 1e-3 absolute, far below the 0.05 the
loss moves per step, so a compiled layer computing anything else (a wrong mask, a lost gradient: the
later steps' losses would not fall alike) fails."""

from __future__ import annotations

import dataclasses

import pytest
from deepspeed_runs import base_run, run

from memfit.train.compile import compile_problem, cpp_compiler

pytestmark = pytest.mark.skipif(compile_problem() is not None, reason=str(compile_problem()))


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 3])
def test_compiled_steps_train_like_eager(demo_model, demo_data, tmp_path, zero):
    eager = dataclasses.replace(
        base_run(demo_model, demo_data, tmp_path / "eager", zero=zero), max_steps=3, save_every=0, eval_every=100
    )
    compiled = dataclasses.replace(eager, out_dir=str(tmp_path / "compiled"), compile=True)
    a, b = run(eager), run(compiled)
    la = [r["loss"] for r in a if r["split"] == "train"]
    lb = [r["loss"] for r in b if r["split"] == "train"]
    assert len(la) == len(lb) == 3
    assert la == pytest.approx(lb, abs=1e-3)
    assert la[-1] < la[0]  # it trains
    log = (tmp_path / "compiled" / "log.txt").read_text()
    assert (
        f"compile: 4 decoder layers (LlamaDecoderLayer) compiled one by one, inductor (CPU, C++: {cpp_compiler()})"
        in log
    )
