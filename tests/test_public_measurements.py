"""The estimator against published, measured GPU memory of fine-tuning runs (issue #16).

The table (tests/public_measurements.yaml) holds figures other people measured on real GPUs,
each with its source and setting; memfit_validation.memory maps every row to an estimator call and
compares the figure that matches the measurement. The targets of the issue are asserted as an
expected failure (strict) with today's numbers in the reason, so the test flips to a failure
-- to be turned into a plain assertion -- the moment the estimator meets them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from memfit_validation import memory as v

from memfit.estimate import Settings
from memfit.estimate.memory.overheads import device_overheads, nvls_bytes
from memfit.estimate.models import catalog

ROWS, OOMS = v.load_table()
RESULTS = [v.compare(r) for r in ROWS]


def test_table_has_at_least_20_sourced_rows():
    assert len(ROWS) >= 20
    for r in ROWS:
        src = r.raw["source"]
        assert ("/" in src) and (r.raw["quote"].strip()), r.id
    # more than one publisher: the table is not one team's numbers
    publishers = {r.id.split("-")[0] for r in ROWS}
    assert len(publishers) >= 4, publishers


def test_every_row_maps_to_a_valid_estimate_of_the_measured_figure():
    for res in RESULTS:
        r = res.row
        assert not res.est.invalid, (r.id, res.est.reason)
        assert res.predicted_bytes == getattr(res.est, v.FIGURE[r.measured]) > 0, r.id
        assert res.published_bytes > 0, r.id
        if r.measured == "max-fit":
            assert res.published_bytes == res.est.device_memory_bytes, r.id


def test_units_are_explicit(tmp_path: Path):
    doc = yaml.safe_load(v.TABLE.read_text())
    row = dict(doc["rows"][0])
    row.pop("unit_note")
    bad = tmp_path / "t.yaml"
    bad.write_text(yaml.safe_dump({"rows": [row]}))
    with pytest.raises(v.TableError, match=r"unit_note"):
        v.load_table(bad)


def test_incomplete_or_wrong_rows_are_named(tmp_path: Path):
    doc = yaml.safe_load(v.TABLE.read_text())
    good = dict(doc["rows"][0])
    cases = [
        ({k: x for k, x in good.items() if k != "seq_len"}, r"lacks \['seq_len'\]"),
        ({**good, "measured": "peak"}, r"measured must be one of"),
        ({**good, "lora_targets": ["qkv"]}, r"unknown LoRA target"),
        ({**good, "model": "no-such-model"}, good["id"]),
        ({**good, "published": {"value": 3, "unit": "TB"}}, r"unit must be one of"),
    ]
    for i, (row, msg) in enumerate(cases):
        p = tmp_path / f"t{i}.yaml"
        p.write_text(yaml.safe_dump({"rows": [row]}))
        with pytest.raises(v.TableError, match=msg):
            v.load_table(p)


def test_settings_reach_the_estimator():
    """A row's LoRA targets, dropout and offload change the estimate the way they should."""
    row = next(r for r in ROWS if r.id == "peft-ds-z3-lora-70b-8xh100")
    base = v.compare(row).predicted_bytes
    no_dropout = dataclasses.replace(row, settings=dataclasses.replace(row.settings, lora_alpha_dropout=False))
    assert v.compare(no_dropout).predicted_bytes < base
    off = next(r for r in ROWS if r.id == "peft-fsdp-qlora-70b-offload")
    on = next(r for r in ROWS if r.id == "peft-fsdp-qlora-70b-no-offload")
    assert off.cand.offload_param == "cpu" and on.cand.offload_param == "none"
    assert v.compare(off).predicted_bytes < v.compare(on).predicted_bytes


def test_oom_rows_do_not_fit():
    assert len(OOMS) >= 2
    for r in OOMS:
        e = v.predict(r)
        assert not e.fits, (r.id, e.device_total_bytes, e.device_memory_bytes)


def test_error_bounds_today():
    """Where the estimator stands now (recorded 2026-11-23, after issue #16's held logits,
    cached logits block, NCCL cuMem and NVLS, and QLoRA dequantization terms, and the table's
    corrected units and settings; 2026-11-26, issue #25: QLoRA's dequantized weight counted in a
    layer's backward only where it exceeds LoRA's own peak there, as measured on the CPU with
    bitsandbytes 0.50, which moved the median from 4.6% to 5.0%): a regression fails here."""
    s = v.summarize(RESULTS)
    assert s.median_abs <= 0.0505, s.line()
    for res in RESULTS:
        if not res.row.explained:
            assert -0.17 <= res.error <= 0.06, (res.row.id, f"{res.error:+.1%}")
            assert -0.17 <= res.range_error <= 0.06, (res.row.id, f"{res.range_error:+.1%}")


def test_explained_rows_say_why():
    for res in RESULTS:
        if res.row.explained:
            assert len(res.row.explained) > 80, res.row.id


# History of the rows that were more than 5% low (measured with
# `.venv/bin/python benchmarks/bench_public.py`):
# - 2026-11-23: peft-ds-z3-lora-70b-8xh100 -9.9%, peft-ds-z3-qlora-70b-2gpu -15.9%,
#   peft-fsdp-qlora-70b-no-offload -13.5% (70B under ZeRO-3/FSDP, 5-6 GiB unaccounted).
# - 2026-11-23 (later): two ZeRO mechanisms from DeepSpeed's source entered the estimator: the reduce
#   bucket is allocated whole however few parameters train (stage3.py IPG buffer), and ZeRO-3
#   keeps parameters gathered for reuse within stage3_max_reuse_distance and prefetches up to
#   stage3_max_live_parameters (zero3.zero3_gathered_bytes; on 2 CPU ranks DeepSpeed 0.19.8 held
#   exactly the elements the replay predicts). The two peft DeepSpeed rows run DeepSpeed's
#   default buckets (no JSON: zero_buckets: deepspeed-defaults). The two QLoRA rows print "GB"
#   without saying which (unit GB-or-GiB: compared as the interval between the readings, -2.3%
#   and -2.0% against its low end). The 8xH100 LoRA row stays -6.1% and is explained in the
#   table (not reconciled: allocator fragmentation under ZeRO-3 and the NCCL version).
# Since then no row is more than 5% low without an explanation in the table.
REMAINING_LOW: tuple[str, ...] = ()


def test_no_row_is_left_low_without_an_explanation():
    """Issue #16's targets: median |error| <= 8% and no row more than 5% low (against its
    interval's low end where it has one) unless the table explains it."""
    s = v.summarize(RESULTS)
    assert s.median_abs <= v.TARGET_MEDIAN, s.line()
    assert set(s.low_unexplained) == set(REMAINING_LOW), s.low_unexplained
    assert s.meets_targets, s.line()


def _with(row: v.Row, **settings) -> v.Row:
    return dataclasses.replace(row, settings=dataclasses.replace(row.settings, **settings))


def test_a_rows_trainer_reaches_the_estimate():
    """The row's loss_impl is the estimator's Settings.logits_handling: torchtune's held fp32
    logits add 4 t V to the reserved peak, transformers >= 4.46's loss 2 t V (bf16) at the loss
    forward; memfit's own trainer (the default) counts neither. Compared on the allocated peak: on
    a GPU without a calibration the reserved rule differs too (another trainer's loss keeps the
    stated heuristic, memfit's the allocator's mechanisms: memfit.estimate.core, issue #42)."""
    for rid, extra in (
        ("torchtune-llama2-7b-lora-4090", 4),
        ("unsloth-hf-fa2-llama3.1-8b-maxctx-24gb", 2),
    ):
        row = next(r for r in ROWS if r.id == rid)
        tv = row.cand.micro_batch * row.cand.seq_len * v.model_card(row.model).vocab_size
        assert row.settings.logits_handling == row.raw["loss_impl"]
        own = v.predict(_with(row, logits_handling="memfit")).peak_allocated_bytes
        assert v.predict(row).peak_allocated_bytes - own == extra * tv, rid


def test_device_level_terms_only_in_device_level_figures():
    """NCCL's communicator and CUDA context are outside torch's counters: a reserved row and
    the same row read as nvidia-smi differ by them; the allocated figure has no cached block."""
    row = next(r for r in ROWS if r.id == "torchtune-llama2-7b-lora-2x4090")
    e = v.predict(row)
    assert e.device_total_bytes - e.peak_reserved_bytes >= v.NCCL_CUMEM_BYTES
    tv4 = 4 * row.cand.micro_batch * row.cand.seq_len * v.model_card(row.model).vocab_size
    assert e.peak_reserved_bytes - e.peak_allocated_bytes >= tv4
    no_cache = v.predict(_with(row, expandable_segments=True))
    assert no_cache.peak_allocated_bytes == e.peak_allocated_bytes
    assert no_cache.peak_reserved_bytes < e.peak_reserved_bytes - tv4 + 1


def test_max_fit_rows_are_not_optimistic_beyond_a_fifth():
    """The longest sequence memfit says fits is within -25%..+20% of the published one on the
    Llama-3.1-8B context sweep (it was +35..+64% before issue #16's terms)."""
    for r in ROWS:
        if r.measured == "max-fit" and "llama3.1-8b" in r.id:
            n = v.max_fitting_seq_len(r)
            assert -0.25 <= n / r.cand.seq_len - 1 <= 0.20, (r.id, n, r.cand.seq_len)


def _row_of(rid: str) -> v.Row:
    return next(r for r in ROWS if r.id == rid)


def test_rounded_figures_are_compared_as_intervals():
    """A whole-GB figure (published_rounding: 1) holds any measurement within +-0.5 GB: inside
    that interval the range error is 0, below it the error is taken against its low end."""
    row = _row_of("llamafactory-llama2-7b-qlora-fa2-s4096")  # 9 GB
    lo, hi = row.published_range
    assert (lo, hi) == (int(8.5 * v.GIB), int(9.5 * v.GIB))
    res = v.compare(row)
    assert res.error < -0.05  # against the printed 9: more than 5% low
    assert res.range_error == pytest.approx(res.predicted_bytes / lo - 1)
    assert -0.05 < res.range_error < 0 and not res.low
    inside = dataclasses.replace(res, predicted_bytes=int(9.2 * v.GIB))
    assert inside.range_error == 0.0
    above = dataclasses.replace(res, predicted_bytes=10 * v.GIB)
    assert above.range_error == pytest.approx(10 / 9.5 - 1)
    far_below = dataclasses.replace(res, predicted_bytes=7 * v.GIB)
    assert far_below.low  # 7 / 8.5 - 1 = -17.6%


def test_upper_bounds_are_never_low_but_can_be_exceeded():
    """A max-fit row's published figure is the device: the run peaked at or below it. A
    prediction below it is not called low; one above it is an error (memfit would say the
    published length does not fit)."""
    row = _row_of("unsloth-hf-fa2-llama3.3-70b-maxctx-a100")
    assert row.published_range == (0, row.published_bytes)
    res = v.compare(row)
    assert res.error < -0.05 and res.range_error == 0.0 and not res.low
    over = dataclasses.replace(res, predicted_bytes=int(res.published_bytes * 1.1))
    assert over.range_error == pytest.approx(0.1, abs=1e-6)


def test_interval_keys_are_checked(tmp_path: Path):
    doc = yaml.safe_load(v.TABLE.read_text())
    lf = next(d for d in doc["rows"] if d["id"] == "llamafactory-llama2-7b-qlora-fa2-s1024")
    maxfit = next(d for d in doc["rows"] if d["id"] == "unsloth-hf-fa2-llama3.1-8b-maxctx-24gb")
    cases = [
        ({**lf, "published_rounding": -1}, r"published_rounding must be a positive number"),
        ({**lf, "published_rounding": 20}, r"published_rounding must be a positive number"),
        ({k: x for k, x in lf.items() if k != "unit_note"}, r"unit_note"),
        ({**lf, "bound": "lower"}, r"bound must be one of"),
        ({**lf, "bound": "upper"}, r"exclude each other"),
        ({k: x for k, x in maxfit.items() if k != "bound"}, r"bound: upper"),
    ]
    for i, (row, msg) in enumerate(cases):
        p = tmp_path / f"t{i}.yaml"
        p.write_text(yaml.safe_dump({"rows": [row]}))
        with pytest.raises(v.TableError, match=msg):
            v.load_table(p)


def test_nvls_buffers_only_on_nvswitch_nodes_with_more_than_two_gpus():
    """NCCL's NVLink-SHARP buffers (overheads.nvls_bytes): 288 MiB per GPU of the node on Hopper
    NVSwitch parts with > 2 GPUs, on top of the cuMem communicator; none on A100 (no
    multicast), PCIe cards or 2 GPUs. The 8x H100 row's nvidia-smi figure carries 2.25 GiB."""
    h100, h200 = catalog.gpu("h100-80gb"), catalog.gpu("h200")
    assert nvls_bytes(h100, 8) == nvls_bytes(h200, 8) == 8 * 288 * 2**20 == int(2.25 * v.GIB)
    assert nvls_bytes(h100, 4) == 4 * 288 * 2**20
    assert nvls_bytes(h100, 16) == nvls_bytes(h100, 8)  # per node: 8 GPUs
    for gpu, world in (("h100-80gb", 2), ("a100-80gb", 8), ("h100-pcie", 8), ("rtx4090", 4)):
        assert nvls_bytes(catalog.gpu(gpu), world) == 0, (gpu, world)
    assert device_overheads(h100, 8)["nccl"] == v.NCCL_CUMEM_BYTES + 8 * 288 * 2**20
    assert device_overheads(h100, 8, Settings(nccl_bytes=v.GIB))["nccl"] == v.GIB
    res = next(r for r in RESULTS if r.row.id == "peft-ds-z3-lora-70b-8xh100")
    assert v.issue16_terms(res)["nvls"] == int(2.25 * v.GIB)
    # two GPUs of the node: the communicator without NVLS buffers (the breakdown's "overheads"
    # also holds fragmentation, which the H100's measured calibration makes a share of the peak)
    assert device_overheads(h100, 2)["nccl"] == v.NCCL_CUMEM_BYTES < device_overheads(h100, 8)["nccl"]
