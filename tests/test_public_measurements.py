"""The estimator against published, measured GPU memory of fine-tuning runs (issue #16).

The table (tests/public_measurements.yaml) holds figures other people measured on real GPUs,
each with its source and setting; memfit.validation maps every row to an estimator call and
compares the figure that matches the measurement. The targets of the issue are asserted as an
expected failure (strict) with today's numbers in the reason, so the test flips to a failure
-- to be turned into a plain assertion -- the moment the estimator meets them.
"""

from __future__ import annotations

import dataclasses
import statistics
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
    """Where the estimator stands now (recorded 2026-11-22): a regression fails here."""
    s = v.summarize(RESULTS)
    assert s.median_abs <= 0.16, s.line()
    for res in RESULTS:
        if not res.row.explained:
            assert -0.26 <= res.error <= 0.10, (res.row.id, f"{res.error:+.1%}")


def test_explained_rows_say_why():
    for res in RESULTS:
        if res.row.explained:
            assert len(res.row.explained) > 80, res.row.id


@pytest.mark.xfail(
    strict=True,
    reason=(
        "issue #16 targets not met yet: on 2026-11-22 (25 rows) median |error| 14.9% "
        "(target <= 8%), 21 rows more than 5% low without explanation, worst unexplained -24.9% "
        "(torchtune-llama2-7b-lora-2x4090); the prototyped changes of "
        "memfit.validation.PROPOSALS bring the median to 5.0% with 10 such rows left"
    ),
)
def test_issue_16_targets():
    s = v.summarize(RESULTS)
    assert s.median_abs <= v.TARGET_MEDIAN, s.line()
    assert not s.low_unexplained, s.low_unexplained


def test_proposed_terms_are_nonnegative_and_help():
    """The prototyped changes only add memory (bias to safety) and lower the median error."""
    after = []
    for res in RESULTS:
        err, terms = v.with_proposals(res)
        assert all(t >= 0 for t in terms.values()), (res.row.id, terms)
        after.append(err)
    now = statistics.median(abs(r.error) for r in RESULTS)
    assert statistics.median(abs(e) for e in after) < now
