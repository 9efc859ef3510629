"""memfit.train.memory: the peak of live tensor storages equals the sizes we allocate; CUDA's own statistics on a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from memfit.train.memory import (
    AllocationTracker,
    device_peaks,
    host_peak_rss_bytes,
    reset_device_peaks,
)
from memfit.units import MIB

FLOAT32 = 4  # bytes


def test_peak_is_the_sum_of_live_tensors_at_the_worst_moment():
    with AllocationTracker("cpu") as t:
        base = t.baseline_bytes
        a = torch.empty(1000, dtype=torch.float32)  # 4,000 B
        b = torch.empty(2000, dtype=torch.float32)  # 8,000 B
        assert t.current_bytes - base == 12_000
        del a
        assert t.current_bytes - base == 8_000  # a freed storage leaves the count at once
        c = torch.empty(500, dtype=torch.float64)  # 4,000 B: below the earlier peak
        assert t.peak_bytes - base == 12_000
        d = torch.empty(10_000, dtype=torch.float16)  # 20,000 B: a new peak (b + c + d)
        assert t.peak_bytes - base == 8_000 + 4_000 + 20_000
        del b, c, d
    assert t.current_bytes == base


def test_views_share_their_storage_and_count_once():
    with AllocationTracker("cpu") as t:
        base = t.baseline_bytes
        x = torch.zeros(256, 256)  # 256 KiB
        views = [x.view(-1), x[:10], x.t(), x.reshape(65536)]
        assert t.current_bytes - base == 256 * 256 * FLOAT32
        y = x + 1  # a new storage
        assert t.peak_bytes - base == 2 * 256 * 256 * FLOAT32
        del views, y


def test_tensors_alive_before_tracking_are_the_baseline(monkeypatch):
    before = torch.empty(50_000, dtype=torch.float32)  # 200,000 B
    with AllocationTracker("cpu") as t:
        assert t.baseline_bytes >= before.nbytes
        out = before.mul_(2)  # in place: no new storage
        assert out.data_ptr() == before.data_ptr()
        assert t.peak_bytes == t.baseline_bytes
        t.reset_peak()
        assert t.peak_bytes == t.current_bytes


def test_device_peaks_on_the_cpu_read_the_tracker():
    if torch.cuda.is_available():
        pytest.skip("on a GPU device_peaks reads the CUDA allocator (see the gpu test)")
    with AllocationTracker("cpu") as t:
        x = torch.empty(1 << 20, dtype=torch.uint8)
        peaks = device_peaks(t)
        del x
    assert peaks.allocated == t.peak_bytes >= MIB
    assert peaks.reserved is None  # the CPU has no caching allocator
    assert device_peaks(None).allocated == 0


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/status is Linux")
def test_host_peak_rss_is_in_bytes():
    # the kernel's own high-water mark, in kB; ru_maxrss is the same figure (getrusage(2))
    status = Path("/proc/self/status").read_text()
    hwm_kib = int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1])
    assert host_peak_rss_bytes() == pytest.approx(hwm_kib * 1024, rel=0.05)


@pytest.mark.gpu
def test_cuda_peaks_see_what_was_allocated_and_the_tracker_agrees():
    device = torch.device("cuda")
    torch.cuda.synchronize()
    reset_device_peaks()
    start = torch.cuda.memory_allocated()
    with AllocationTracker(device) as t:
        a = torch.empty(64 * MIB, dtype=torch.uint8, device=device)
        b = torch.empty(32 * MIB // 4, dtype=torch.float32, device=device)
        del a
        c = torch.empty(16 * MIB, dtype=torch.uint8, device=device)
        torch.cuda.synchronize()
        peaks = device_peaks(t)
        del b, c
    # the caching allocator rounds each block up (to 512 B, or 2 MiB segments); these sizes are multiples
    assert peaks.allocated - start == 96 * MIB
    assert t.peak_bytes - t.baseline_bytes == 96 * MIB
    assert peaks.reserved >= peaks.allocated


# -- the cpu device capacity ------------------------------------------------------------


def test_capacity_raises_cuda_oom_type_at_the_op_that_crosses_it():
    keep = torch.ones(1000)  # baseline: alive before tracking starts, counts toward the capacity
    with AllocationTracker("cpu") as probe:
        base = probe.baseline_bytes
    assert base >= keep.nbytes
    cap = base + 100_000  # room for 100,000 B more than the baseline
    with AllocationTracker("cpu", capacity_bytes=cap) as t:
        t.phase = "forward"
        a = torch.empty(15_000)  # 60,000 B: fits
        assert t.oom is None
        with pytest.raises(torch.OutOfMemoryError, match="forward"):
            torch.zeros(15_000)  # another 60,000 B: 120,000 B above baseline > capacity
        assert t.oom["phase"] == "forward"
        assert "zeros" in t.oom["op"]
        assert t.oom["capacity_bytes"] == cap
        assert t.oom["live_bytes"] == base + 120_000  # the outputs exist when the check runs
        assert t.current_bytes == base + 60_000  # ...and are dropped with the error
        t.phase = "backward"
        with pytest.raises(torch.OutOfMemoryError, match="backward"):
            a * 0.5  # another 60,000 B
        assert t.oom["phase"] == "backward"
        del a
        small = torch.empty(1000)  # after the failures, what fits still allocates
        assert t.current_bytes == base + small.nbytes


def test_capacity_phase_and_baseline_are_reported():
    with AllocationTracker("cpu") as probe:
        base = probe.baseline_bytes
    with AllocationTracker("cpu", capacity_bytes=base + 40_000) as t:
        t.phase = "optimizer step"
        x = torch.empty(5_000)  # 20,000 B
        with pytest.raises(torch.OutOfMemoryError) as e:
            x.add_(1).mul(2).clone()  # mul: +20,000 B fits (40,000), clone: +20,000 B does not
        assert "optimizer step" in str(e.value)
        assert t.oom["phase"] == "optimizer step" and "clone" in t.oom["op"]
        del x


def test_baseline_over_capacity_raises_when_tracking_starts():
    params = torch.ones(100_000)  # 400,000 B, like parameters allocated before the step
    t = AllocationTracker("cpu", capacity_bytes=100_000)
    with pytest.raises(torch.OutOfMemoryError, match="baseline"):
        t.__enter__()
    assert t.oom["phase"] == "setup" and t.oom["live_bytes"] >= params.nbytes
