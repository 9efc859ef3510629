"""Checkpoint files mapped and copied a chunk at a time (memfit.train.stream_load): what a resume
holds on the host beyond training is one chunk, not the file; the values are torch.load's."""

from __future__ import annotations

import sys

import pytest
import torch

from memfit.train import stream_load
from memfit.train.memory import AllocationTracker
from memfit.units import MIB

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status and madvise(2)")

N = 48 * MIB // 4  # 48 MiB of fp32 per tensor


def _hwm_growth(fn) -> int:
    """How far this process's peak RSS rose above its RSS while `fn` ran (Linux: writing 5 to
    /proc/self/clear_refs resets VmHWM to the current RSS, proc(5))."""

    def kib(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = kib("VmRSS:")
    fn()
    return (kib("VmHWM:") - before) * 1024


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "optim.pt"
    g = torch.Generator().manual_seed(0)
    saved = {"m": torch.randn(N, generator=g), "v": torch.rand(N, generator=g), "step": torch.tensor(7.0)}
    torch.save(saved, path)
    with stream_load.streamed_loading():  # the dispatch machinery's one-time imports, before any measure
        stream_load.load(str(path), map_location="cpu")["step"].clone()
    return path, saved


def test_copies_into_existing_state_map_one_chunk_where_torch_load_reads_the_file(checkpoint):
    path, saved = checkpoint
    m, v = torch.zeros(N), torch.zeros(N)  # the state that exists before the load

    def plain():
        sd = torch.load(path, map_location="cpu", weights_only=False)
        m.copy_(sd["m"])
        v.copy_(sd["v"])

    def streamed():
        with stream_load.streamed_loading():
            sd = stream_load.load(str(path), map_location="cpu")
            assert stream_load.is_file_backed(sd["m"])
            m.copy_(sd["m"])
            v.copy_(sd["v"])

    plain_growth = _hwm_growth(plain)
    m.zero_(), v.zero_()
    streamed_growth = _hwm_growth(streamed)
    assert torch.equal(m, saved["m"]) and torch.equal(v, saved["v"])
    assert plain_growth >= 2 * N * 4 * 0.95  # torch.load holds both tensors at once
    # a mapped chunk (CHECKPOINT_CHUNK_BYTES, 64 MiB > one 48 MiB tensor) plus torch's own bookkeeping
    assert streamed_growth <= N * 4 + 8 * MIB, (streamed_growth, plain_growth)


def test_conversions_and_clones_stream_and_own_their_memory(checkpoint, monkeypatch):
    path, saved = checkpoint
    monkeypatch.setattr(stream_load, "CHUNK_BYTES", 4 * MIB)  # many chunks per tensor

    def streamed():
        with stream_load.streamed_loading():
            sd = stream_load.load(str(path), map_location="cpu")
            out["bf16"] = sd["m"].to(torch.bfloat16)
            out["clone"] = sd["v"].clone()
            assert not stream_load.is_file_backed(out["clone"])

    out: dict[str, torch.Tensor] = {}
    growth = _hwm_growth(streamed)
    assert torch.equal(out["bf16"], saved["m"].to(torch.bfloat16)) and torch.equal(out["clone"], saved["v"])
    # the two results (72 MiB) and about one 4 MiB chunk mapped at a time; not the 96 MiB file
    assert growth <= N * 2 + N * 4 + 12 * MIB, growth


def test_adopted_state_gets_memory_of_its_own_before_the_file_goes(checkpoint, tmp_path):
    """torch's Optimizer.load_state_dict adopts a loaded CPU tensor as the state (no copy): memfit
    gives it memory of its own inside the load, so deleting or rewriting the checkpoint (keep_last
    rotation) cannot change a training state."""
    path, saved = checkpoint
    copy = tmp_path / "optim.pt"
    copy.write_bytes(path.read_bytes())
    p = torch.nn.Parameter(torch.zeros(N))
    opt = torch.optim.Adam([p])
    with stream_load.streamed_loading():
        sd = stream_load.load(str(copy), map_location="cpu")
        opt.state[p] = {"exp_avg": sd["m"], "exp_avg_sq": sd["v"], "step": sd["step"]}  # adopted, as torch does
        assert stream_load.is_file_backed(opt.state[p]["exp_avg"])
        assert stream_load.own_memory(torch.nn.Linear(2, 2), opt) == 3
        assert not any(stream_load.is_file_backed(t) for t in opt.state[p].values())
    del sd
    copy.write_bytes(b"\0" * 64)  # rewritten in place: a mapping of it would now read zeros or fault
    assert torch.equal(opt.state[p]["exp_avg"], saved["m"]) and torch.equal(opt.state[p]["exp_avg_sq"], saved["v"])


def test_the_tracker_counts_the_state_not_the_mapped_file(checkpoint):
    """On the CPU device memfit's AllocationTracker is the device memory measure: a mapped file's
    pages are page cache, so a load into existing state adds nothing to its live bytes."""
    path, _ = checkpoint
    m = torch.zeros(N)
    with AllocationTracker() as tracker:
        base = tracker.current_bytes
        with stream_load.streamed_loading():
            sd = stream_load.load(str(path), map_location="cpu")
            m.copy_(sd["m"])
            del sd
        assert tracker.peak_bytes - base < MIB, tracker.peak_bytes - base


def test_files_torch_cannot_map_load_as_before(tmp_path):
    """Legacy (non-zip) torch.save files load whole, as DeepSpeed would."""
    path = tmp_path / "legacy.pt"
    torch.save({"x": torch.arange(5)}, path, _use_new_zipfile_serialization=False)
    with stream_load.streamed_loading():
        sd = stream_load.load(str(path), map_location="cpu")
        assert torch.equal(sd["x"], torch.arange(5)) and not stream_load.is_file_backed(sd["x"])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_loading_the_model_holds_its_weights_once(tmp_path, precision):
    """The start of training (and the DPO reference, loaded the same way): transformers maps the
    safetensors file, so `load_model` needs the weights once in host RAM, not file + copy: in the
    dtype as saved no more than the file (the pages are the kernel's page cache, shared by a
    node's ranks); converted (an fp32 file trained in bf16), the bf16 weights beside the file's
    pages as they pass."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from memfit.space import Candidate
    from memfit.train.modeling import load_model

    cfg = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")  # ~25M parameters, ~100 MB in fp32
    file_bytes = (tmp_path / "m" / "model.safetensors").stat().st_size
    load_model(str(tmp_path / "m"), Candidate(precision=precision, attn="sdpa"), trainable=False)  # imports, once
    out = {}
    growth = _hwm_growth(
        lambda: out.setdefault(
            "m", load_model(str(tmp_path / "m"), Candidate(precision=precision, attn="sdpa"), trainable=False)
        )
    )
    weights = sum(p.numel() * p.element_size() for p in out["m"].parameters())
    if precision == "fp32":  # the dtype as saved: never the file plus a copy
        assert growth <= file_bytes + 16 * MIB, (growth, file_bytes)
    else:  # converted: the bf16 weights, and the fp32 file's pages as they pass
        assert growth <= weights + file_bytes + 16 * MIB, (growth, file_bytes, weights)
