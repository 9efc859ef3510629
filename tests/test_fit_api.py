"""The Python API's longest fit (`memfit.estimate.fit`, `fit_sequence_parallel`) searches from the
same smallest value as `memfit fit`: 2 tokens (the next-token loss needs two), so a model whose
activations are traced answers instead of failing on seq_len 1. The tiny demo Llama traced in
this process: seconds per test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit.estimate import Settings, fit
from memfit.estimate.models import catalog
from memfit.estimate.search import fit_sequence_parallel
from memfit.space import Candidate
from memfit.units import GIB

ROOT = Path(__file__).resolve().parents[1]
TINY = json.loads((ROOT / "config" / "models" / "demo-tiny.json").read_text())
CAND = Candidate(zero=0, attn="sdpa", grad_ckpt=False, precision="fp32", micro_batch=1, seq_len=24)


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """The demo model with a 256-token context, traced once for the module's tests (one cache)."""
    tmp = tmp_path_factory.mktemp("fit-api")
    path = tmp / "config.json"
    path.write_text(json.dumps(TINY | {"max_position_embeddings": 256}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEMFIT_TRACE_IN_PROCESS", "1")  # a tiny model traces faster than a child starts
        yield catalog.model(str(path)), Settings(activations="traced", trace_cache=str(tmp / "traces"))


def test_python_fit_of_a_traced_model_answers(traced):
    """It used to trace seq_len 1 first and fail: `seq_len must be >= 2 (next-token loss), got 1`."""
    arch, settings = traced
    gpu = catalog.gpu("cpu")
    best, est = fit(arch, gpu, 1, 1, "sft", CAND, "seq_len", budget_bytes=GIB, settings=settings)
    assert best == 256 and est is not None and est.activations_source == "traced"  # the context bounds it


def test_python_fit_that_fits_nothing_reports_the_smallest_length_it_tried(traced):
    arch, settings = traced
    gpu = catalog.gpu("cpu")
    best, est = fit(arch, gpu, 1, 1, "sft", CAND, "seq_len", budget_bytes=1024, settings=settings)
    assert best == 0 and est is not None and not est.fits_with_headroom  # not a trace error at 1 token


def test_fit_sequence_parallel_of_a_traced_model_answers(traced):
    arch, settings = traced
    got = fit_sequence_parallel(arch, catalog.gpu("cpu"), 2, 1, "sft", CAND, budget_bytes=GIB, settings=settings)
    assert got and all(v >= 2 for v in got.values())
