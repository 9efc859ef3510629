"""Reserved memory from the caching allocator's mechanisms (memfit.estimate.memory.allocator), the device
margin derived from memfit's measured device-total error (issue #42), and the calibration keys
that carry both. Each allocator term on a hand-computed case; the margin as `estimate` and the
workflow's budget state it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from memfit.estimate import estimate, rows
from memfit.estimate.memory import allocator
from memfit.estimate.memory.states import ModelStates
from memfit.estimate.models import calibration, catalog
from memfit.estimate.models.calibration import CalibrationError
from memfit.estimate.settings import Settings
from memfit.space import Candidate
from memfit.units import GIB, MIB

PADDED = Settings(variable_length=False)
CAL_DIR = Path(__file__).resolve().parents[1] / "config" / "calibration"


def _reserved(allocated, states=None, cand=None, world=1, logits=0, settings=PADDED, share=None):
    phases = SimpleNamespace(allocated=allocated)  # reserved() reads each phase's allocated bytes
    return allocator.reserved(phases, states or ModelStates(), cand or Candidate(), world, logits, 0, settings, share)


def test_segments_round_to_2_mib_plus_the_small_pool():
    """kRoundLarge: 2 MiB segments; one partly used small-pool segment and the last large
    segment's rounding beside it (SEGMENT_ROUNDING = 4 MiB)."""
    assert allocator.round_segment(1) == 2 * MIB
    assert allocator.round_segment(2 * MIB) == 2 * MIB
    assert allocator.round_segment(2 * MIB + 1) == 4 * MIB
    top = 10 * GIB + 3 * MIB + 5
    r = _reserved({"forward": top})
    assert r.bytes == 10 * GIB + 4 * MIB + 4 * MIB
    assert r.terms == {
        "logits_cached": 0,
        "variable_length": 0,
        "step_cached": 0,
        "side_stream": 0,
        "rounding": r.bytes - top,
    }


def test_the_cached_share_of_the_fp32_logits_block():
    """Half the fp32 block by default (the next forward's 16-bit logits are carved out of it); a
    calibration's measured share instead."""
    block = 1000 * MIB
    default = _reserved({"loss_backward": 20 * GIB}, logits=block)
    assert default.phase == "forward_backward" and default.terms["logits_cached"] == 500 * MIB
    assert default.bytes == 20 * GIB + 500 * MIB + 4 * MIB
    h100 = _reserved({"loss_backward": 20 * GIB}, logits=block, share=0.671)
    assert h100.terms["logits_cached"] == int(0.671 * block)


def test_deepspeeds_flat_gradient_copy_is_cached_at_the_optimizer_step():
    """The copies freed before the update (step_grads - update_grads) stay cached: the ZeRO-2 16-bit
    flat copy of 1.92e9 parameters, 3.84 GB, as the H100 rows measured (3.82 GB)."""
    states = ModelStates(step_grads=2 * 3_840_000_000, update_grads=3_840_000_000)
    r = _reserved({"loss_backward": 40 * GIB, "optimizer_step": 42 * GIB}, states=states, logits=100 * MIB)
    assert r.phase == "optimizer_step"
    assert r.terms["step_cached"] == 3_840_000_000 and r.terms["logits_cached"] == 0
    assert r.bytes == allocator.round_segment(42 * GIB + 3_840_000_000) + 4 * MIB


def test_zero3_side_stream_pool_only_on_several_ranks():
    """ZeRO-3 gathers on its own all-gather stream: its blocks stay reserved beside the optimizer
    step's at world > 1; one rank gathers nothing."""
    states = ModelStates(gathered=3 * GIB)
    alloc = {"forward": 10 * GIB, "optimizer_step": 12 * GIB}
    two = _reserved(alloc, states=states, cand=Candidate(zero=3), world=2)
    assert two.phase == "optimizer_step" and two.terms["side_stream"] == 3 * GIB
    assert two.bytes == 15 * GIB + 4 * MIB
    one = _reserved(alloc, states=states, cand=Candidate(zero=3), world=1)
    assert one.terms["side_stream"] == 0 and one.bytes == 12 * GIB + 4 * MIB
    z2 = _reserved(alloc, states=states, cand=Candidate(zero=2), world=2)
    assert z2.terms["side_stream"] == 0


def test_expandable_segments_count_no_split_waste():
    """Segments grow in place: neither the logits remainder nor the flat gradient copy."""
    exp = Settings(variable_length=False, expandable_segments=True)
    states = ModelStates(step_grads=8 * GIB, update_grads=4 * GIB)
    alloc = {"loss_backward": 20 * GIB, "optimizer_step": 19 * GIB}
    r = _reserved(alloc, states=states, logits=GIB, settings=exp)
    assert r.terms["logits_cached"] == r.terms["step_cached"] == 0
    assert r.bytes == 20 * GIB + 4 * MIB
    assert _reserved(alloc, states=states, logits=GIB).bytes > 23 * GIB  # the same without it


def _est(gpu, headroom, **kw):
    cand = Candidate(finetune="lora", seq_len=2048, **kw)
    return estimate(catalog.model("llama-3.1-8b"), catalog.gpu(gpu), 1, 1, "sft", cand, headroom=headroom)


def test_the_derived_margin_per_gpu_and_a_given_headroom_wins():
    """No headroom given: the calibrated H100/H200 keep 5% free (their files' device_margin), a GPU
    without a file 7% (UNCALIBRATED_MARGIN), each said in headroom_source; a given one is used."""
    h100 = _est("h100-80gb", None)
    assert h100.headroom == 0.05 and "h100-80gb" in h100.headroom_source
    assert h100.usable_device_bytes == int(h100.device_memory_bytes * 0.95)
    assert _est("h200", None).headroom == 0.05
    a100 = _est("a100-80gb", None)
    assert a100.headroom == calibration.UNCALIBRATED_MARGIN == 0.07 and "uncalibrated" in a100.headroom_source
    given = _est("h100-80gb", 0.2)
    assert given.headroom == 0.2 and given.headroom_source == "given"
    # the workflow's budget: the same margin, and where it comes from, in selected.json's budget
    b = rows.derived_budget(80 * GIB, 512 * GIB, "h100-80gb", "9.0")
    assert (b.headroom, b.device_limit_bytes) == (0.05, int(80 * GIB * 0.95))
    assert rows.budget_from_json({**b.__dict__}).headroom_source == b.headroom_source
    assert rows.derived_budget(80 * GIB, 512 * GIB, "a100-80gb", "8.0").headroom == 0.07


def test_margin_for_adds_the_safety_and_rounds_up():
    """The worst device-total under-prediction plus MARGIN_SAFETY (2%), rounded up to a percent."""
    assert calibration.margin_for(-0.029) == 0.05
    assert calibration.margin_for(-0.049) == 0.07
    assert calibration.margin_for(0.03) == 0.02  # over-predicted everywhere: the safety alone


@pytest.mark.parametrize(
    "key,value,words",
    [
        ("logits_cached_share", 3, "logits_cached_share must be a share of the fp32 logits block in [0, 2], got 3"),
        ("logits_cached_share", "0.6", "logits_cached_share must be"),
        ("device_margin", 0.6, "device_margin must be a fraction of device memory in [0, 0.5), got 0.6"),
        ("device_margin", -0.01, "device_margin must be"),
    ],
)
def test_a_bad_calibration_key_names_the_file_and_the_key(tmp_path, key, value, words):
    doc = json.loads((CAL_DIR / "h100-80gb.json").read_text())
    doc[key] = value
    path = tmp_path / "h100-80gb.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(CalibrationError) as err:
        calibration.for_gpu("h100-80gb", "9.0", tmp_path)
    assert str(path) in str(err.value) and words in str(err.value)


def test_the_workflow_budget_derives_the_margin_when_headroom_is_auto_or_absent():
    """config's `headroom: auto` or no headroom key: the derived margin, its source in the budget
    (selected.json); a number is kept as given."""
    from memfit.workflow.config import WorkflowConfig, load_yaml

    raw = load_yaml(Path(__file__).resolve().parents[1] / "config" / "gpu-demo.yaml")
    given = WorkflowConfig({**raw, "headroom": 0.10}).budget("h100-80gb")
    assert (given.headroom, given.headroom_source) == (0.10, "given")
    auto = WorkflowConfig({**raw, "headroom": "auto"}).budget("h100-80gb")
    assert auto.headroom == 0.05 and "h100-80gb" in auto.headroom_source
    absent = WorkflowConfig({k: v for k, v in raw.items() if k != "headroom"}).budget("a100-80gb")
    assert absent.headroom == 0.07 and "uncalibrated" in absent.headroom_source


@pytest.mark.parametrize("headroom", ["auto", None])
def test_the_schema_takes_auto_or_no_headroom_and_refuses_it_for_the_cpu(headroom):
    """The shipped GPU configs say `headroom: auto`; the CPU has no measured margin, so a CPU
    config must give a number, and the refusal names the key."""
    from memfit.workflow.config import ConfigError, load_yaml, validate_config

    root = Path(__file__).resolve().parents[1]
    validate_config(load_yaml(root / "config" / "gpu-demo.yaml") | {"gpus": ["h100-80gb"]})  # says auto
    raw = load_yaml(root / "config" / "config.yaml")
    raw = {k: v for k, v in raw.items() if k != "headroom"} | ({"headroom": headroom} if headroom else {})
    with pytest.raises(ConfigError, match=r"headroom: 'auto' \(or omitted\) has no measured margin for the cpu device"):
        validate_config(raw)
