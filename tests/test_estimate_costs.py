"""Device overheads, fragmentation, host memory and step time (memfit.estimate.memory.overheads, memfit.estimate.time.costs)."""

from __future__ import annotations

import dataclasses

import pytest

from memfit.estimate import (
    Settings,
    cached_logits_block,
    device_overheads,
    fragmentation,
    host_memory,
    model_states,
    step_time,
)
from memfit.estimate.memory.overheads import NCCL_CUMEM_BYTES
from memfit.estimate.models import calibration, catalog
from memfit.estimate.models.params import param_layout
from memfit.estimate.time.costs import step_flops
from memfit.space import Candidate
from memfit.units import CHECKPOINT_CHUNK_BYTES, GIB, MIB


def test_device_overheads_by_gpu_and_world():
    assert sum(device_overheads(catalog.gpu("cpu"), 8).values()) == 0
    a100, h100_pcie = catalog.gpu("a100-80gb"), catalog.gpu("h100-pcie")
    assert device_overheads(a100, 1) == {"cuda_context": 500 * MIB, "cublas": 9 * MIB, "nccl": 0}
    assert device_overheads(h100_pcie, 2)["cublas"] == 69_206_016  # measured on the H100 and H200 (no file of its own)
    # the H100 and the H200 are calibrated (config/calibration/<gpu>.json, measured by benchmarks/gpu_evidence.py)
    for name in ("h100-80gb", "h200"):
        cal = calibration.for_gpu(name, "9.0")
        assert cal.measured and device_overheads(catalog.gpu(name), 2)["cublas"] == cal.cublas_workspace_bytes
    # NCCL >= 2.19 cuMem communicator: vLLM's measured 1.79 GiB per process, any world > 1
    assert device_overheads(a100, 2)["nccl"] == device_overheads(a100, 64)["nccl"] == NCCL_CUMEM_BYTES
    assert 1.7 * GIB < NCCL_CUMEM_BYTES < 1.8 * GIB
    assert device_overheads(a100, 8, Settings(nccl_bytes=256 * MIB))["nccl"] == 256 * MIB
    assert device_overheads(catalog.gpu("cpu"), 8, Settings(nccl_bytes=GIB))["nccl"] == 0  # gloo
    assert device_overheads(catalog.gpu("v100-32gb"), 1)["cuda_context"] == 400 * MIB


def test_measured_calibration_keeps_its_nccl_figure(tmp_path, monkeypatch):
    """A calibration file measured on the GPU keeps its own NCCL per-peer figure."""
    import json

    from memfit.estimate.models import calibration

    a100 = catalog.gpu("a100-80gb")
    (tmp_path / "a100-80gb.json").write_text(
        json.dumps(
            {
                "device": "a100-80gb",
                "cuda_context_bytes": 520 * MIB,
                "cublas_workspace_bytes": 9 * MIB,
                "nccl_bytes_per_peer": 64 * MIB,
                "nccl_max_bytes": 512 * MIB,
                "measured_on": "2026-11-01",
            }
        )
    )
    monkeypatch.setattr(calibration, "CALIBRATION_DIR", tmp_path)
    assert device_overheads(a100, 2)["nccl"] == 64 * MIB
    assert device_overheads(a100, 16)["nccl"] == 512 * MIB


def test_a_one_gpu_calibration_leaves_the_nccl_figure_alone(tmp_path, monkeypatch):
    """benchmarks/gpu_evidence.py measures on one GPU: no NCCL communicator, so its calibration
    states no NCCL figure and a multi-GPU estimate keeps the measured communicator size
    (NCCL_CUMEM_BYTES plus NVLS) instead of a per-peer guess."""
    import json

    from memfit.estimate.models import calibration

    h100 = catalog.gpu("h100-80gb")
    before = device_overheads(h100, 8)["nccl"]
    d = {"device": "h100-80gb", "cuda_context_bytes": 600 * MIB, "cublas_workspace_bytes": 64 * MIB}
    (tmp_path / "h100-80gb.json").write_text(json.dumps(d | {"measured_on": "2026-11-26"}))
    monkeypatch.setattr(calibration, "CALIBRATION_DIR", tmp_path)
    assert device_overheads(h100, 8) == {"cuda_context": 600 * MIB, "cublas": 64 * MIB, "nccl": before}
    (tmp_path / "h100-80gb.json").write_text(json.dumps(d | {"measured_on": "2026-11-26", "nccl_max_bytes": 1}))
    calibration._load_cached.cache_clear()
    with pytest.raises(calibration.CalibrationError, match="go together"):
        device_overheads(h100, 8)


def test_cached_logits_block_only_with_a_caching_allocator():
    b = 4 * 2048 * 128256
    assert cached_logits_block(b, Settings(), is_cpu=False) == b
    assert cached_logits_block(b, Settings(), is_cpu=True) == 0
    assert cached_logits_block(b, Settings(expandable_segments=True), is_cpu=False) == 0


def test_fragmentation_shares():
    n = 10 * GIB
    assert fragmentation(n, Settings(), is_cpu=True) == 0
    assert fragmentation(n, Settings(), is_cpu=False) == int(0.30 * n)
    assert fragmentation(n, Settings(variable_length=False), is_cpu=False) == int(0.08 * n)
    assert fragmentation(n, Settings(expandable_segments=True), is_cpu=False) == int(0.03 * n)


def test_host_memory_grows_with_offload_and_resume_peaks_only_with_deepspeeds_load():
    arch, gpu, s = catalog.model("qwen2.5-7b"), catalog.gpu("a100-80gb"), Settings()
    plain = Candidate(zero=3)
    offload = Candidate(zero=3, offload_optimizer="cpu", offload_param="cpu", pin_memory=True)
    h0 = host_memory(arch, plain, gpu, model_states(arch, plain, 8, s), 8, 8, s)
    h1 = host_memory(arch, offload, gpu, model_states(arch, offload, 8, s), 8, 8, s)
    # memfit's trainer maps the files and copies a chunk at a time: one chunk per rank beyond steady
    assert h0.phases["resume"] == h0.phases["steady"] + 8 * CHECKPOINT_CHUNK_BYTES < h0.peak
    # DeepSpeed's load reads each rank's shard whole: 12 bytes per parameter over the node's 8 ranks
    ds = dataclasses.replace(s, trainer_loader="deepspeed")
    h0_ds = host_memory(arch, plain, gpu, model_states(arch, plain, 8, ds), 8, 8, ds)
    assert h0_ds.peak == h0_ds.phases["resume"] > h0.peak
    shard_and_module = 12 * param_layout(arch).total + 2 * param_layout(arch).total
    assert h0_ds.phases["resume"] - h0_ds.phases["steady"] == pytest.approx(shard_and_module, rel=1e-6)
    assert h1.breakdown["offloaded_optimizer"] > 0 and h1.breakdown["offloaded_params"] > 0
    assert h1.breakdown["pinned_rounding"] >= 0 and h1.peak > h0.peak
    assert h0.breakdown["offloaded_optimizer"] == h0.breakdown["offloaded_params"] == 0


def test_step_time_terms():
    arch, gpu, s = catalog.model("llama-3.1-8b"), catalog.gpu("a100-80gb"), Settings()
    one = Candidate(zero=2)
    t1 = step_time(arch, one, gpu, "sft", 1, 1, model_states(arch, one, 1, s), s)
    assert t1["communication"] == 0.0 and t1["offload"] == 0.0 and t1["compute"] > 0
    t8 = step_time(arch, one, gpu, "sft", 8, 1, model_states(arch, one, 8, s), s)
    assert t8["communication"] > 0 and t8["optimizer"] < t1["optimizer"]
    ckpt = Candidate(zero=2, grad_ckpt=True)
    tc = step_time(arch, ckpt, gpu, "sft", 1, 1, model_states(arch, ckpt, 1, s), s)
    # recomputation: the layers' forward once more (8/6 of their FLOPs), not the head's
    lay = param_layout(arch)
    attention = arch.num_layers * one.seq_len * arch.num_attention_heads * arch.head_dim
    layers, head = lay.total - lay.embed - lay.lm_head + attention, lay.lm_head
    flops = step_flops(arch, ckpt, "sft") / step_flops(arch, one, "sft")
    assert flops == pytest.approx((4 * layers + 3 * head) / (3 * layers + 3 * head), rel=1e-9)
    # the time: the layers' GEMMs, attention and element-wise ops once more, not the head or loss
    assert 1.2 < tc["compute"] / t1["compute"] < flops
    dpo = step_time(arch, one, gpu, "dpo", 1, 1, model_states(arch, one, 1, s, "dpo"), s)
    assert dpo["compute"] > 2 * t1["compute"]  # twice the sequences plus the reference forward
