"""Same-world resume stays bit-exact for ZeRO-2 with micro batch 4 and an evaluation at the
checkpoint step (the demo's shape: global batch 32 = 4 micro x 4 accum x 2 ranks), the case where
a ~1e-7 relative loss difference was once seen."""

import dataclasses

import pytest
import torch
from safetensors.torch import load_file
from test_resume_universal import base_run, data, interrupted_copy, rows_of, run  # noqa: F401 - data is a fixture

pytestmark = pytest.mark.slow


def test_zero2_micro4_resume_with_eval_at_the_checkpoint_is_bit_exact(demo_model, data, tmp_path):  # noqa: F811
    ref_cfg = dataclasses.replace(base_run(demo_model, data, tmp_path / "ref", zero=2, micro_batch=4, grad_accum=4),
                                  max_steps=6, save_every=3, eval_every=3)
    ref = run(ref_cfg, 2)
    out = tmp_path / "resumed"
    interrupted_copy(tmp_path / "ref", out, "step00000003")
    rows = run(dataclasses.replace(ref_cfg, out_dir=str(out)), 2)
    assert "resumed from" in (out / "log.txt").read_text()
    for split in ("train", "eval"):
        assert rows_of(rows, split) == rows_of(ref, split), split
    a = load_file(str(tmp_path / "ref/model/model.safetensors"))
    b = load_file(str(out / "model/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
