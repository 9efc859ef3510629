"""The traced step's attention FLOPs (memfit.estimate.trace.trace_flops): memfit's own count, not the
installed torch's.

- on SDPA's CPU kernel (what a trace runs), with multi-head, grouped-query and multi-query k/v,
  with and without a mask, causal masking and dropout, memfit counts what torch 2.13's counter
  counts (its SDPA formula applied to the CPU kernel), forward and whole step;
- the CUDA kernels a trace never runs (flash, memory-efficient, cuDNN, their packed-sequence and
  varlen forms) are counted per sequence as torch 2.13 counts them, and their dense (b, s, h, d)
  layout as the same attention through SDPA;
- a torch whose counter refuses grouped-query attention (PyTorch 2.11: "sdpa_flop_count:
  query/key/value shapes are incompatible") no longer fails a traced estimate of a GQA model,
  nor changes its numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torch.utils.flop_counter as fc

from memfit.estimate.trace.trace_flops import attention_formulas, counter

REPO = Path(__file__).resolve().parents[1]
aten = torch.ops.aten

# (query heads, key/value heads): multi-head, grouped-query, multi-query
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
VARIANTS = {
    "plain": {},
    "causal": {"is_causal": True},
    "bool_mask": {"attn_mask": "bool"},
    "float_mask": {"attn_mask": "float"},
    "dropout": {"dropout_p": 0.1},
}
B, S_Q, S_K, D = 2, 8, 6, 16


def _torch_count(q, k, v, backward: bool) -> int:
    """torch's own SDPA count, or a skip where this torch refuses the shapes (older than 2.13
    for grouped-query attention)."""
    try:
        if backward:
            return fc.sdpa_backward_flop_count((q[0], q[1], q[2], v[3]), q, k, v)
        return fc.sdpa_flop_count(q, k, v)
    except AssertionError as exc:
        pytest.skip(f"torch {torch.__version__} does not count these shapes: {exc}")


def _torch_registry(op, args) -> int:
    """torch's flop_registry entry for `op` on `args`, or a skip where it refuses them."""
    try:
        return fc.flop_registry[op](*args, out_val=None)
    except AssertionError as exc:
        pytest.skip(f"torch {torch.__version__} does not count these shapes: {exc}")


def _closed_form(q, k, v, backward: bool) -> int:
    b, h_q, s_q, d_q = q
    s_k, d_v = k[2], v[3]
    return 2 * b * h_q * s_q * s_k * ((3 * d_q + 2 * d_v) if backward else (d_q + d_v))


def _sdpa_inputs(h_kv: int, variant: dict):
    torch.manual_seed(0)
    q = torch.randn(B, 4, S_Q, D, requires_grad=True)
    k = torch.randn(B, h_kv, S_K, D, requires_grad=True)
    v = torch.randn(B, h_kv, S_K, D, requires_grad=True)
    kwargs = dict(variant)
    if kwargs.get("attn_mask") == "bool":
        kwargs["attn_mask"] = torch.ones(S_Q, S_K, dtype=torch.bool).tril()
    elif kwargs.get("attn_mask") == "float":
        kwargs["attn_mask"] = torch.randn(B, 1, S_Q, S_K)
    return q, k, v, kwargs


def _run(mode, q, k, v, kwargs) -> tuple[int, int]:
    """(forward, whole step) FLOPs of one SDPA forward + backward under `mode`."""
    with mode:
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
        fwd = mode.get_total_flops()
        out.sum().backward()
    return fwd, mode.get_total_flops()


def _torch_mode():
    """torch's FlopCounterMode, its SDPA formulas applied to the CPU kernel as to the CUDA ones."""
    return fc.FlopCounterMode(
        display=False,
        custom_mapping={
            aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *a, out_shape=None, **kw: _torch_count(
                q, k, v, backward=False
            ),
            aten._scaled_dot_product_flash_attention_for_cpu_backward: lambda g, q, k, v, *a, out_shape=None, **kw: (
                _torch_count(q, k, v, backward=True)
            ),
        },
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("heads", list(HEADS))
def test_cpu_sdpa_counts_as_torch_2_13_counts(heads, variant):
    h_q, h_kv = HEADS[heads]
    q, k, v, kwargs = _sdpa_inputs(h_kv, VARIANTS[variant])
    ours = counter()
    fwd, step = _run(ours, q, k, v, kwargs)
    theirs_fwd, theirs_step = _run(_torch_mode(), *_sdpa_inputs(h_kv, VARIANTS[variant]))
    assert (fwd, step) == (theirs_fwd, theirs_step)
    shapes = (B, h_q, S_Q, D), (B, h_kv, S_K, D), (B, h_kv, S_K, D)
    if variant != "dropout":  # the CPU kernel ran (dropout runs SDPA's math path: its bmm's)
        assert fwd == _closed_form(*shapes, backward=False)
        assert step - fwd == _closed_form(*shapes, backward=True)
        assert ours.measures()["attn_flops"] == step  # all of it the attention kernels'


def _meta(*shape):
    return torch.empty(*shape, device="meta")


# the CUDA SDPA ops, (b, h, s, d): their arguments after query, key, value (forward) and after
# grad_out, query, key, value (backward), as their schemas take them
SDPA_CUDA = {
    aten._scaled_dot_product_flash_attention: lambda q, k, v: (q, k, v, 0.0, False),
    aten._scaled_dot_product_efficient_attention: lambda q, k, v: (q, k, v, None, True),
    aten._scaled_dot_product_cudnn_attention: lambda q, k, v: (q, k, v, None, True),
    aten._scaled_dot_product_flash_attention_backward: lambda g, q, k, v: (g, q, k, v, g, None, None, None, 8, 8),
    aten._scaled_dot_product_efficient_attention_backward: lambda g, q, k, v: (g, q, k, v, None, g, None),
    aten._scaled_dot_product_cudnn_attention_backward: lambda g, q, k, v: (g, q, k, v, g, None, None, None),
}


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("op", list(SDPA_CUDA), ids=str)
def test_cuda_sdpa_ops_count_as_torch_2_13_counts(op, heads):
    h_q, h_kv = HEADS[heads]
    q, k, v = _meta(B, h_q, S_Q, D), _meta(B, h_kv, S_K, D), _meta(B, h_kv, S_K, 12)  # d_v != d_q
    backward = op._qualified_op_name.endswith("_backward")
    args = SDPA_CUDA[op](_meta(B, h_q, S_Q, 12), q, k, v) if backward else SDPA_CUDA[op](q, k, v)
    ours = attention_formulas()[op](*args, out_val=None)
    assert ours == _closed_form(q.shape, k.shape, v.shape, backward)
    assert ours == _torch_registry(op, args)


# packed batches: three sequences of 3, 5, 2 queries and 5, 4, 7 keys
CUM_Q, CUM_K, MAX_Q, MAX_K = [0, 3, 8, 10], [0, 5, 9, 16], 5, 7


def _packed_args(op, h_q, h_kv, offsets_device):
    """A packed-batch call of `op`: (total, h, d) for flash and varlen, (1, total, h, d) for the
    memory-efficient kernel; d_v = d_q (torch 2.13's packed backward expects grad_out as query)."""
    cq = torch.tensor(CUM_Q, dtype=torch.int32, device=offsets_device)
    ck = torch.tensor(CUM_K, dtype=torch.int32, device=offsets_device)
    lead = (1,) if "efficient" in op._qualified_op_name else ()
    q, k, v = _meta(*lead, 10, h_q, D), _meta(*lead, 16, h_kv, D), _meta(*lead, 16, h_kv, D)
    g = _meta(*q.shape)
    return {
        aten._flash_attention_forward: (q, k, v, cq, ck, MAX_Q, MAX_K, 0.0, False, False),
        aten._flash_attention_backward: (g, q, k, v, g, None, cq, ck, MAX_Q, MAX_K, 0.0, False, None, None),
        aten._efficient_attention_forward: (q, k, v, None, cq, ck, MAX_Q, MAX_K, 0.0, 0),
        aten._efficient_attention_backward: (g, q, k, v, None, g, cq, ck, MAX_Q, MAX_K, None, 0.0, None, None, 0),
    }[op]


def _per_sequence(h_q, h_kv, backward: bool, lens_q, lens_k) -> int:
    return sum(
        _closed_form((1, h_q, sq, D), (1, h_kv, sk, D), (1, h_kv, sk, D), backward)
        for sq, sk in zip(lens_q, lens_k, strict=True)
    )


PACKED = [
    aten._flash_attention_forward,
    aten._flash_attention_backward,
    aten._efficient_attention_forward,
    aten._efficient_attention_backward,
]


@pytest.mark.parametrize("offsets_device", ["cpu", "meta"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("op", PACKED, ids=str)
def test_packed_attention_counts_each_sequence_as_torch_2_13(op, heads, offsets_device):
    """Offsets with values: each sequence at its length; without (meta, as fake tensors are):
    every sequence at the longest."""
    h_q, h_kv = HEADS[heads]
    args = _packed_args(op, h_q, h_kv, offsets_device)
    backward = op._qualified_op_name.endswith("_backward")
    ours = attention_formulas()[op](*args, out_val=None)
    if offsets_device == "cpu":
        expected = _per_sequence(h_q, h_kv, backward, [3, 5, 2], [5, 4, 7])
    else:
        expected = _per_sequence(h_q, h_kv, backward, [MAX_Q] * 3, [MAX_K] * 3)
    assert ours == expected
    assert ours == _torch_registry(op, args)


@pytest.mark.parametrize("heads", list(HEADS))
def test_dense_flash_and_efficient_kernels_count_as_the_same_attention_through_sdpa(heads):
    """The flash and memory-efficient kernels take (b, s, h, d) tensors: counted as SDPA's
    (b, h, s, d) of the same attention (torch 2.13's registry reads them as (b, h, s, d))."""
    h_q, h_kv = HEADS[heads]
    q, k, v = _meta(B, S_Q, h_q, D), _meta(B, S_K, h_kv, D), _meta(B, S_K, h_kv, D)
    f = attention_formulas()
    sdpa = f[aten._scaled_dot_product_flash_attention](q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    sdpa_bwd = f[aten._scaled_dot_product_flash_attention_backward](
        q.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    )
    assert f[aten._flash_attention_forward](q, k, v, None, None, S_Q, S_K, 0.0, False, False) == sdpa
    assert f[aten._efficient_attention_forward](q, k, v, None, None, None, None, None, 0.0, 0) == sdpa
    assert f[aten._flash_attention_backward](q, q, k, v, q, None, None, None, S_Q, S_K, 0.0, False, None, None) == (
        sdpa_bwd
    )
    assert f[aten._efficient_attention_backward](q, q, k, v, None, q, None, None, S_Q, S_K, None, 0.0) == sdpa_bwd
    assert sdpa == _closed_form((B, h_q, S_Q, D), (B, h_kv, S_K, D), (B, h_kv, S_K, D), False)


def test_varlen_attention_counts_each_sequence():
    varlen = pytest.importorskip("torch.nn.attention.varlen")  # registers torch_attn ops
    del varlen
    ops = torch.ops.torch_attn
    f = attention_formulas()
    h_q, h_kv = HEADS["gqa"]
    cq, ck = torch.tensor(CUM_Q), torch.tensor(CUM_K)
    q, k, v = _meta(10, h_q, D), _meta(16, h_kv, D), _meta(16, h_kv, D)
    fwd = _per_sequence(h_q, h_kv, False, [3, 5, 2], [5, 4, 7])
    assert f[ops._varlen_attn](q, k, v, cq, ck, MAX_Q, MAX_K, False) == fwd
    assert f[ops._varlen_attn_out](q, q, k, v, cq, ck, MAX_Q, MAX_K, False) == fwd
    bwd = f[ops._varlen_attn_backward](q, q, k, v, q, None, cq, ck, MAX_Q, MAX_K, False)
    assert bwd == _per_sequence(h_q, h_kv, True, [3, 5, 2], [5, 4, 7])
    # self-attention without key offsets: the queries'
    assert f[ops._varlen_attn](q, _meta(10, h_kv, D), _meta(10, h_kv, D), cq, None, MAX_Q, MAX_Q, False) == (
        _per_sequence(h_q, h_kv, False, [3, 5, 2], [3, 5, 2])
    )


# A traced estimate of a GQA model in a child process (as memfit traces: no fake tensor outlives
# it in the pytest process), first with this torch's counter, then with one that refuses GQA as
# PyTorch 2.11's does; each into its own empty trace cache, the in-process memos cleared.
_ESTIMATE = """
import contextlib, io, json, sys
from pathlib import Path
from unittest import mock
import torch.utils.flop_counter as fc
from memfit.estimate import main
from memfit.estimate.trace import trace, trace_flops

config, root = sys.argv[1], Path(sys.argv[2])

def estimate(cache):
    trace.clear_memo()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["--model", config, "--gpu", "h100-80gb", "--zero", "0", "--attn", "sdpa",
                   "--seq-len", "32", "--micro-batch", "2", "--activations", "traced",
                   "--trace-cache", str(cache), "--json"])
    runs = [json.loads(p.read_text())["runs"] for p in sorted(cache.glob("*.json"))]
    return {"rc": rc, "estimate": json.loads(out.getvalue()), "runs": runs}

def refuse(*args, **kwargs):
    raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")

plain = estimate(root / "plain")
seen = []
count = trace_flops._attention_flops
def spy(q, k, v, backward):
    seen.append((int(q[1]), int(k[1])))
    return count(q, k, v, backward)
attention = {op: refuse for op in fc.flop_registry if "attention" in str(op) or "attn" in str(op)}
with (mock.patch.object(fc, "sdpa_flop_count", refuse), mock.patch.object(fc, "sdpa_backward_flop_count", refuse),
      mock.patch.dict(fc.flop_registry, attention), mock.patch.object(trace_flops, "_attention_flops", spy)):
    patched = estimate(root / "patched")
print(json.dumps({"plain": plain, "patched": patched, "heads_seen": sorted(set(seen)),
                  "patched_ops": len(attention)}))
"""


def test_a_counter_refusing_gqa_changes_no_traced_estimate(tmp_path):
    config = REPO / "config/models/demo-tiny.json"
    cfg = json.loads(config.read_text())
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # a GQA model
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), MEMFIT_TRACE_IN_PROCESS="1")
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_ESTIMATE), str(config), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    plain, patched = res["plain"], res["patched"]
    assert res["patched_ops"] >= 10  # torch's attention entries, all refusing
    assert patched["rc"] == plain["rc"] == 0
    assert patched["estimate"] == plain["estimate"]
    assert patched["runs"] and patched["runs"] == plain["runs"]  # traced afresh, every measure equal
    heads = (cfg["num_attention_heads"], cfg["num_key_value_heads"])
    assert list(heads) in res["heads_seen"]  # the kernel ran with k/v of fewer heads
    one, two = patched["runs"][0]["1"], patched["runs"][0]["2"]
    # one layer's forward attention, per sequence of 32 tokens, at the query's heads
    d = cfg["head_dim"]
    assert two["fwd_attn_flops"] - one["fwd_attn_flops"] == 2 * heads[0] * 32 * 32 * (d + d)
