"""The estimator against published, measured GPU memory of fine-tuning runs (issue #16).

The table (tests/public_measurements.yaml) holds figures other people measured on real GPUs,
each with its source and setting; memfit.validation maps every row to an estimator call and
compares the figure that matches the measurement. The targets of the issue are asserted as an
expected failure (strict) with today's numbers in the reason, so the test flips to a failure
-- to be turned into a plain assertion -- the moment the estimator meets them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from memfit import validation as v

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
    no_dropout = dataclasses.replace(
        row, settings=dataclasses.replace(row.settings, lora_alpha_dropout=False)
    )
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
    cached logits block, NCCL cuMem and QLoRA dequantization terms): a regression fails here."""
    s = v.summarize(RESULTS)
    assert s.median_abs <= 0.05, s.line()
    for res in RESULTS:
        if not res.row.explained:
            assert -0.17 <= res.error <= 0.05, (res.row.id, f"{res.error:+.1%}")


def test_explained_rows_say_why():
    for res in RESULTS:
        if res.row.explained:
            assert len(res.row.explained) > 80, res.row.id


# The rows that stay more than 5% low, and why (measured 2026-11-23 with
# `.venv/bin/python benchmarks/bench_public.py`); none is reconciled by a mechanism with a source:
# - peft-ds-z3-lora-70b-8xh100 (-13.4%): 8 H100s on NVSwitch; NCCL's NVLink-SHARP buffers
#   (`nvlsTotalSize`, vllm issue #9699) come on top of the cuMem communicator and are not counted
#   (no published size to count them with);
# - peft-ds-z3-qlora-70b-2gpu (-15.9%), peft-fsdp-qlora-70b-no-offload (-13.5%): 70B QLoRA
#   sharded over 2 GPUs (bitsandbytes with bf16 quant storage, ZeRO-3 / FSDP); not reconciled:
#   FSDP gathers whole decoder layers (and prefetches the next) where memfit counts DeepSpeed's
#   largest module, about 1 GiB here, not the 5 GiB gap;
# - torchtune-llama2-7b-lora-2x4090 (-12.8%), torchtune-llama2-7b-lora-4090 (-5.4%): reserved
#   memory of torchtune's LoRA recipes beyond the held fp32 logits; the 2-GPU row assumes
#   activation checkpointing on where its config says off (see the row's notes);
# - unsloth-hf-fa2-llama3.3-70b-maxctx-a100 (-8.2%): a max-fit row, 70B QLoRA on one A100; the
#   published figure is the device (80 GB), an upper bound of the run's peak;
# - llamafactory-llama2-7b-qlora-fa2-s2048/-s4096 (-5.6%, -8.3%), llamafactory-llama2-7b-lora-hf
#   (-5.5%): the figures are whole GB (the rows' unit_note); against the lowest value that rounds
#   to them (6.5, 8.5, 17.5 GiB) the errors are +1.7%, -2.8%, -2.8%.
REMAINING_LOW = (
    "peft-ds-z3-lora-70b-8xh100",
    "peft-ds-z3-qlora-70b-2gpu",
    "peft-fsdp-qlora-70b-no-offload",
    "torchtune-llama2-7b-lora-4090",
    "torchtune-llama2-7b-lora-2x4090",
    "unsloth-hf-fa2-llama3.3-70b-maxctx-a100",
    "llamafactory-llama2-7b-qlora-fa2-s2048",
    "llamafactory-llama2-7b-qlora-fa2-s4096",
    "llamafactory-llama2-7b-lora-hf",
)


def test_the_rows_left_low_are_the_ones_named():
    """The median target is met; the rows more than 5% low without an explanation in the
    table are exactly the ones named above (a new one, or one fixed, fails here)."""
    s = v.summarize(RESULTS)
    assert s.median_abs <= v.TARGET_MEDIAN, s.line()
    assert set(s.low_unexplained) == set(REMAINING_LOW), s.low_unexplained


@pytest.mark.xfail(
    strict=True,
    reason=(
        "issue #16 targets not met yet: on 2026-11-23 (25 rows) median |error| 4.6% "
        "(target <= 8%: met), 9 rows more than 5% low without explanation (REMAINING_LOW), worst "
        "unexplained -15.9% (peft-ds-z3-qlora-70b-2gpu)"
    ),
)
def test_issue_16_targets():
    s = v.summarize(RESULTS)
    assert s.median_abs <= v.TARGET_MEDIAN, s.line()
    assert not s.low_unexplained, s.low_unexplained


def _with(row: v.Row, **settings) -> v.Row:
    return dataclasses.replace(row, settings=dataclasses.replace(row.settings, **settings))


def test_a_rows_trainer_reaches_the_estimate():
    """The row's loss_impl is the estimator's Settings.logits_handling: torchtune's held fp32
    logits add 4 t V to the reserved peak, transformers >= 4.46's loss 2 t V (bf16) at the loss
    forward; memfit's own trainer (the default) counts neither."""
    for rid, extra in (
        ("torchtune-llama2-7b-lora-4090", 4),
        ("unsloth-hf-fa2-llama3.1-8b-maxctx-24gb", 2),
    ):
        row = next(r for r in ROWS if r.id == rid)
        tv = row.cand.micro_batch * row.cand.seq_len * v._model(row.model).vocab_size
        assert row.settings.logits_handling == row.raw["loss_impl"]
        own = v.compare(_with(row, logits_handling="memfit")).predicted_bytes
        assert v.compare(row).predicted_bytes - own == extra * tv, rid


def test_device_level_terms_only_in_device_level_figures():
    """NCCL's communicator and CUDA context are outside torch's counters: a reserved row and
    the same row read as nvidia-smi differ by them; the allocated figure has no cached block."""
    row = next(r for r in ROWS if r.id == "torchtune-llama2-7b-lora-2x4090")
    e = v.predict(row)
    assert e.device_total_bytes - e.peak_reserved_bytes >= v.NCCL_CUMEM_BYTES
    tv4 = 4 * row.cand.micro_batch * row.cand.seq_len * v._model(row.model).vocab_size
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
