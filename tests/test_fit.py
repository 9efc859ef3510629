"""`memfit fit --maximize` (memfit.estimate.fit) as a user runs it: a traced model answers (the
search starts at 2 tokens and reads the traces' fitted form), the answer is the boundary under
real traces, --allow-beyond-context searches past the context up to memory, --max-seq-len bounds
it, `limited_by` says what stopped the search, progress goes to stderr and stdout holds only the
JSON. The tiny demo Llama (config/models/demo-tiny.json) traced in this process on the CPU budget
the demo uses: seconds per test."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from memfit import cli

ROOT = Path(__file__).resolve().parents[1]
TINY = json.loads((ROOT / "config" / "models" / "demo-tiny.json").read_text())
LEVERS = ["--gpu", "cpu", "--attn", "sdpa", "--zero", "0", "--headroom", "0"]


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """The demo model with an 8,192-token context, and a trace cache of this test's own."""
    monkeypatch.setenv("MEMFIT_TRACE_IN_PROCESS", "1")  # a tiny model traces faster than a child starts
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY | {"max_position_embeddings": 8192}))
    return ["--model", str(path), "--activations", "traced", "--trace-cache", str(tmp_path / "traces"), *LEVERS]


def _fit(argv, capsys):
    rc = cli.main(["fit", "--maximize", "seq_len", *argv, "--json"])
    out, err = capsys.readouterr()
    return rc, json.loads(out), err  # stdout is the JSON and nothing else


def _estimate(argv, seq_len, capsys) -> dict:
    rc = cli.main(["estimate", *argv, "--seq-len", str(seq_len), "--json"])
    got = json.loads(capsys.readouterr().out)
    assert rc in (0, 1) and got["activations_source"] == "traced"
    return got


# an answer above the traced lengths (read on the fitted form), one below them (traced itself)
@pytest.mark.parametrize("extra", [[], ["--micro-batch", "16"]])
def test_traced_model_fit_answers_and_is_the_boundary(tiny, extra, capsys):
    """Traced activations: `fit` answers (it used to fail on seq_len 1), and `memfit estimate` with a
    real trace says the answer fits and one token more does not."""
    argv = [*tiny, "--budget-gib", "0.07", *extra]
    rc, got, err = _fit(argv, capsys)
    best = got["seq_len"]
    assert rc == 0 and best >= 2 and got["limited_by"] == "memory" and got["activations_source"] == "traced"
    assert "seq_len must be >= 2" not in err
    assert _estimate(argv, best, capsys)["fits_with_headroom"]
    assert not _estimate(argv, best + 1, capsys)["fits_with_headroom"]
    if best >= 512:
        assert got["traced_lengths"] == [512, 1024, 2048]
    else:  # below the traced lengths: the answer and the length above it traced for real
        assert {best, best + 1} <= set(got["traced_lengths"]) and "checking " in err


def test_progress_goes_to_stderr_a_line_per_step(tiny, capsys):
    rc, got, err = _fit([*tiny, "--budget-gib", "0.07"], capsys)
    steps = [ln for ln in err.splitlines() if ln.startswith("memfit fit: seq_len ")]
    assert rc == 0 and len(steps) >= 10  # a bisection over 2..8,192
    assert steps[0].startswith("memfit fit: seq_len 2: fits (device ")
    assert steps[1].startswith("memfit fit: seq_len 8,192: does not fit (device ")
    assert any(ln.startswith("memfit fit: tracing ") for ln in err.splitlines())
    assert f"memfit fit: seq_len {got['seq_len']:,}: fits" in err
    # each traced shape says when it is done and how long it took (memfit.estimate.trace.trace.progress_to)
    done = [ln for ln in err.splitlines() if ln.startswith("memfit fit: traced ")]
    assert {re.search(r" at ([\d,]+) tokens", ln)[1] for ln in done} == {"512", "1,024", "2,048"}
    assert all(re.search(r" in \d+\.\d s ", ln) for ln in done), done


def test_limited_by_context_then_memory_beyond_it(tiny, capsys):
    """A budget the whole context fits in: the context stopped it. With --allow-beyond-context the
    search goes past the context until memory stops it; --max-seq-len bounds it."""
    argv = [*tiny, "--budget-gib", "0.5"]
    rc, got, _ = _fit(argv, capsys)
    assert rc == 0 and got["seq_len"] == 8192
    assert got["limited_by"] == f"{tiny[1]}'s context (max_position_embeddings): 8192"

    rc, beyond, err = _fit([*argv, "--allow-beyond-context"], capsys)
    assert rc == 0 and beyond["seq_len"] > 8192 and beyond["limited_by"] == "memory"
    assert "memfit fit: seq_len 16,384: " in err  # doubling past the context
    assert not _estimate([*argv, "--allow-beyond-context"], beyond["seq_len"] + 1, capsys)["fits_with_headroom"]

    rc, capped, _ = _fit([*argv, "--allow-beyond-context", "--max-seq-len", "10000"], capsys)
    assert rc == 0 and capped["seq_len"] == 10000 and capped["limited_by"] == "--max-seq-len: 10000"


def test_table_says_what_stopped_it(tiny, capsys):
    rc = cli.main(["fit", "--maximize", "seq_len", *tiny, "--budget-gib", "0.5", "--max-seq-len", "4000"])
    out = capsys.readouterr().out
    assert rc == 0 and "largest seq_len that fits: 4000 (the search's bound, --max-seq-len; not a memory limit)" in out


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--maximize", "seq_len", "--max-seq-len", "9000"], "--max-seq-len 9000 is beyond"),
        (["--maximize", "seq_len", "--max-seq-len", "1"], "--max-seq-len must be >= 2"),
        (
            ["--maximize", "micro_batch", "--max-seq-len", "4096"],
            "--max-seq-len does nothing with --maximize micro_batch",
        ),
    ],
)
def test_bad_max_seq_len_is_refused_before_tracing(tiny, extra, needle, tmp_path, capsys):
    rc = cli.main(["fit", *extra, *tiny])
    out, err = capsys.readouterr()
    assert rc == 2 and f"memfit fit: error: {needle}" in err and "Traceback" not in err and not out
    assert not (tmp_path / "traces").exists() or not any((tmp_path / "traces").iterdir())


def test_nothing_fits_when_the_states_alone_do_not_traces_one_length(tiny, capsys):
    """A budget the weights and optimizer states alone exceed: exit 1 with seq_len 0, after one
    traced length (no search over lengths that cannot change the answer)."""
    rc = cli.main(["fit", "--maximize", "seq_len", *tiny, "--budget-gib", "0.01", "--json"])
    out, err = capsys.readouterr()
    got = json.loads(out)
    assert rc == 1 and got["seq_len"] == 0 and got["limited_by"] == "memory"
    assert got["traced_lengths"] == [512] and "memfit fit: seq_len 2: does not fit" in err
    assert any("the weights and states alone exceed the usable memory" in n for n in got["notes"])
    rc = cli.main(["fit", "--maximize", "seq_len", *tiny, "--budget-gib", "0.01"])
    assert rc == 1 and "nothing fits: even seq_len=2 needs more memory" in capsys.readouterr().out


# ALST's one-GPU levers on Llama-3.1-8B (README's "through the CLI" command, one GPU): the tiled
# MLP's rows padded to a multiple of its tiles make memory non-monotonic in the length
ALST_1GPU = (
    "--model llama-3.1-8b --gpu h100-80gb --num-gpus 1 --zero 3 --offload-optimizer cpu --offload-param cpu "
    "--loss-impl chunked --tiled-mlp --activation-offload --expandable-segments --host-memory-gb 1900 "
    "--headroom 0 --allow-beyond-context"
).split()


def test_tiled_mlp_answer_is_every_length_below_fits_whatever_the_bound(capsys):
    """With the tiled MLP a multiple of the tiles fits where shorter padded lengths do not (610,304
    fitted, 580,000 did not): the answer is the longest length below which every length fits, the
    same with or without a bound, and the lengths just below it and below its tile count fit."""
    answers = {}
    for bound in ([], ["--max-seq-len", "64000000"], ["--max-seq-len", "1000000"]):
        rc, got, err = _fit([*ALST_1GPU, *bound], capsys)
        assert rc == 0 and got["limited_by"] == "memory", got["limited_by"]
        answers[tuple(bound)] = got["seq_len"]
    best = answers[()]
    assert set(answers.values()) == {best}, answers

    def fits(n: int) -> bool:  # as `memfit estimate` says with the same flags
        assert cli.main(["estimate", *ALST_1GPU, "--seq-len", str(n), "--no-advice", "--json"]) in (0, 1)
        return json.loads(capsys.readouterr().out)["fits_with_headroom"]

    tile = 4096  # Llama-3.1-8B's hidden size: the default tile tokens
    below_tiles = (-(-best // tile) - 1) * tile  # where the answer's tile count begins
    assert all(fits(n) for n in [*range(best - 24, best + 1), *range(below_tiles - 24, below_tiles + 24)])
    assert fits(best) and not fits(best + 1)
    assert 610_304 > best and fits(610_304)  # the multiple of the tiles that used to be answered


@pytest.mark.slow
def test_linear_attention_layers_are_traced_short_and_read_exactly_beyond(tmp_path):
    """Qwen3.5's linear-attention layers (a Python loop over 64-token chunks: their trace's time
    grows with the length) are traced at LINEAR_TRACE_LENGTHS, its full-attention layers at
    TRACE_LENGTHS; the fitted form from the short lengths gives a real trace at 1,536 tokens (24
    chunks, beyond them) to the byte, every measure (the tiny Qwen3.5; qwen3.5-27b's layer at 2,048
    tokens likewise, fit.py's LINEAR_TRACE_LENGTHS)."""
    from memfit.estimate.fit import LINEAR_TRACE_LENGTHS, TRACE_LENGTHS, FittedTraces, _quadratic
    from memfit.estimate.models import catalog
    from memfit.estimate.settings import Settings
    from memfit.estimate.trace import trace

    arch = catalog.model(str(ROOT / "config" / "models" / "tiny-qwen3-5-text.json"), allow_moe=True)
    shape = trace.TraceRequest(0, "sdpa", "bf16", True, "lora")
    traces = FittedTraces(arch, [shape], Settings(trace_cache=str(tmp_path)), lambda line: None)
    (linear,) = [c for c in traces.cards if traces.labels[c] == "linear_attention"]
    (full,) = [c for c in traces.cards if traces.labels[c] == "full_attention"]
    assert traces.schedule(linear) == LINEAR_TRACE_LENGTHS == (256, 512, 1024)
    assert traces.schedule(full) == TRACE_LENGTHS
    reqs = [dataclasses.replace(shape, seq_len=n) for n in (256, 1024, 512, 1536)]  # two children, even
    got = {t.key["seq_len"]: t for t in trace.layer_traces(linear, reqs, cache_dir=tmp_path, workers=2)}
    fitted = _quadratic({n: got[n] for n in LINEAR_TRACE_LENGTHS}, 1536)
    assert fitted.runs == got[1536].runs


@pytest.mark.slow
def test_kinds_of_layer_share_one_set_of_trace_workers_kept_for_the_search(tmp_path, monkeypatch):
    """A model that mixes kinds of layer (the tiny Qwen3.5: linear and full attention) is traced
    with one set of trace workers: both kinds' shapes at once on trace_workers() processes, the
    same processes again for the next round of lengths (their imports and caches paid once, not
    once per kind and round), none left once the search is over; and every trace is the one the
    kind traced on its own gives, to the byte."""
    import multiprocessing

    from memfit.estimate.fit import FittedTraces
    from memfit.estimate.models import catalog
    from memfit.estimate.settings import Settings
    from memfit.estimate.trace import trace

    monkeypatch.delenv("MEMFIT_TRACE_IN_PROCESS", raising=False)
    monkeypatch.setenv("MEMFIT_TRACE_WORKERS", "2")
    arch = catalog.model(str(ROOT / "config" / "models" / "tiny-qwen3-5-text.json"), allow_moe=True)
    shape = trace.TraceRequest(0, "sdpa", "bf16", True, "lora")
    lines: list[str] = []
    traces = FittedTraces(arch, [shape], Settings(trace_cache=str(tmp_path / "shared")), lines.append)
    assert len(traces.cards) == 2
    before = set(multiprocessing.active_children())
    with trace.progress_to(lines.append), traces:
        traces.add([64])
        first = set(multiprocessing.active_children()) - before
        traces.add([96, 128])
        second = set(multiprocessing.active_children()) - before
    assert len(first) == 2 and second == first  # one pair of workers, both kinds, both rounds
    assert not set(multiprocessing.active_children()) - before  # closed with the search
    assert sum(ln.startswith("tracing ") and " layers) at " in ln for ln in lines) == 4  # each kind, each round
    assert sum(ln.startswith("traced ") and " layers) at " in ln for ln in lines) == 6  # each kind at 3 lengths
    for card in traces.cards:  # each kind on its own, in a cache of its own
        alone = trace.layer_traces(
            card, [dataclasses.replace(shape, seq_len=n) for n in (64, 96, 128)], tmp_path / "alone"
        )
        assert [t.runs for t in alone] == [traces.points[(card, shape)][n].runs for n in (64, 96, 128)]
