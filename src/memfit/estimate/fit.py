"""`memfit fit`'s search: the largest seq_len (from 2 tokens: the next-token loss needs two) or
micro batch that fits, for every model memfit estimates, with a line of progress per step.

    best = maximize(arch, gpu, 8, 1, "sft", cand, "seq_len", bound=None, say=print)
    best.value, best.limited_by, best.sweep   # 548_124, "memory", {1: ..., 2: ..., 8: ...}

Memory grows with both (every activation has a token and a batch dimension), so the search is a
bisection between the smallest value and the bound; with no bound (`--allow-beyond-context`
without `--max-seq-len`) the value doubles until it stops fitting, then bisects.

A model whose activations are traced (memfit.estimate.trace.trace: a catalog entry without a
hand-written card, a config.json transformers builds, `--activations traced`) is not traced at
every step of the search. Each measure of a trace (bytes and FLOPs per sequence) is a polynomial
of degree <= 2 in the length: activations are linear in the tokens, eager attention's scores and
every attention's FLOPs quadratic (Korthikanti et al. 2022, sec. 4.1; Dao 2023, FlashAttention-2,
sec. 3.2). So the model is traced at TRACE_LENGTHS (every kind of layer at once, on one pool of
worker processes kept for the search) and a step reads the quadratic through the three traced
lengths nearest its own, exact at a traced length (smollm3-3b: traced at 3,000 and 300,000
tokens, every measure as the quadratic through 4,096, 16,384 and 65,536 predicts it, to the
byte). A chunked linear
attention (Qwen3.5, Qwen3-Next) pads to whole 64-token chunks: between multiples of 64 the form is
off by less than one chunk's share of that layer (0.13% of its peak at 1,531 tokens, measured).
An answer below the traced lengths (where a sliding window or a chunk may change the shapes) is
traced itself, with the length above it, and the search runs again until both are real traces
(at most MAX_ROUNDS rounds; else a note says the answer is the fitted form's). When the
weights and states alone do not fit, nothing does: the answer comes after one traced length. The longest
sequence at each sequence-parallel size (`sweep`) reads the same form.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

from memfit.estimate.core import Estimate, Job, _estimable, _estimate, per_rank
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.models.catalog import GPU
from memfit.estimate.models.generic import layer_groups
from memfit.estimate.models.validity import model_problems
from memfit.estimate.search import SEARCH_CAP, largest_fitting, sequence_parallel_sizes
from memfit.estimate.settings import DEFAULT_SETTINGS, EstimateError, Settings
from memfit.estimate.trace import traced as traced_mod
from memfit.methods import shape as method_shape
from memfit.space import Candidate
from memfit.units import GIB

MIN_SEQ_LEN = 2  # the next-token loss needs two tokens (trace.trace_key refuses fewer)
# Lengths traced first. Short: a linear-attention layer (Qwen3.5, Qwen3-Next's gated delta rule)
# runs a Python loop over 64-token chunks, so its trace takes time in proportion to the length
# (12 s to 32 s a trace here); fake tensors make the other layers cost about the same at any length.
TRACE_LENGTHS = (512, 1024, 2048)
# A kind of layer whose label (generic.layer_groups: config.layer_types) is linear attention
# (Qwen3.5, Qwen3-Next: the gated delta rule's Python loop over 64-token chunks) is traced at
# these instead: its trace's time grows with the chunks (qwen3.5-27b's, CPU seconds in one
# process: 13.9, 13.5, 23.2, 30.8 at 256, 512, 1,024, 2,048 tokens) and every measure is exact
# on the quadratic through them (the same layer traced at 2,048 tokens: every measure as
# predicted, to the byte, 2026-11-27; tests/test_fit.py checks the tiny Qwen3.5 likewise).
LINEAR_TRACE_LENGTHS = (256, 512, 1024)
MAX_ROUNDS = 4  # trace-and-search rounds before the fitted form's answer stands (with a note)


@dataclass
class Answer:
    """What the search found: the value (0: even the smallest does not fit), the estimate there
    (at the smallest when nothing fits), what stopped it, and how it was reached."""

    value: int
    estimate: Estimate | None
    limited_by: str  # "memory", or "<the bound's label>: <bound>"
    sweep: dict[int, int] = field(default_factory=dict)  # seq_len: {sequence parallel size: longest}
    traced_lengths: list[int] = field(default_factory=list)  # per-rank lengths traced (traced models)
    notes: list[str] = field(default_factory=list)


class FittedTraces:
    """Traces of one model at a few lengths per layer kind and trace shape, read at any length
    as the quadratic through the three traced lengths nearest it (registered in
    memfit.estimate.trace.traced.EXTRAPOLATED while the search runs)."""

    def __init__(self, arch: ModelArch, shapes, settings: Settings, say: Callable[[str], None]):
        groups = layer_groups(arch)
        self.cards = [card for _, card, _ in groups]
        self.labels = {card: label for _, card, label in groups}
        self.shapes = list(shapes)  # TraceRequests with seq_len 0
        self.settings, self.say, self.name = settings, say, arch.name
        self.points: dict[tuple, dict[int, object]] = {(c, s): {} for c in self.cards for s in self.shapes}

    @property
    def lengths(self) -> list[int]:
        return sorted({n for pts in self.points.values() for n in pts})

    def schedule(self, card) -> tuple[int, ...]:
        """The lengths a kind of layer is traced at first (LINEAR_TRACE_LENGTHS: see there)."""
        return LINEAR_TRACE_LENGTHS if "linear_attention" in self.labels[card] else TRACE_LENGTHS

    def traced(self, card) -> set[int]:
        return set.intersection(*(set(self.points[(card, s)]) for s in self.shapes))

    def traced_everywhere(self, lengths) -> bool:
        return all(set(lengths) <= self.traced(card) for card in self.cards)

    def add(self, lengths=None, first: bool = False) -> None:
        """Trace every (layer kind, shape) at `lengths` (None: each kind's schedule, or its first
        length with `first`) not traced yet: one batch per layer kind, the kinds at once on one
        pool of trace workers (trace.layer_traces_of_kinds; inside `with`, the same pool for
        every call: a worker keeps what its first trace imported and cached)."""
        from memfit.estimate.trace import trace

        todo = {}
        for card in self.cards:
            want = self.schedule(card)[:1] if first else (self.schedule(card) if lengths is None else lengths)
            new = sorted({int(n) for n in want if n >= MIN_SEQ_LEN} - self.traced(card))
            if new:
                todo[card] = new
        if not todo:
            return
        per_kind = "; ".join(
            f"{self.labels[c] + ' ' if len(self.cards) > 1 else ''}at {', '.join(f'{n:,}' for n in ns)} tokens"
            for c, ns in todo.items()
        )
        self.say(f"tracing {self.name} {per_kind}")
        # the longest traces first, so that no worker is left with one alone at the end: a linear
        # attention's (its chunk loop: 7.6 s at 1,024 tokens against 2.3 s for the full-attention
        # layer: qwen3.5-35b-a3b in one process, 2026-11-28) and of a kind the longest lengths
        kinds = sorted(todo, key=lambda c: self.schedule(c) != LINEAR_TRACE_LENGTHS)
        batches = [
            (c, [dataclasses.replace(s, seq_len=n) for n in reversed(todo[c]) for s in self.shapes]) for c in kinds
        ]
        try:
            done = trace.layer_traces_of_kinds(batches, cache_dir=self.settings.trace_cache)
        except trace.TraceError as exc:
            raise EstimateError(str(exc)) from None
        for (card, reqs), got in zip(batches, done, strict=True):
            for r, t in zip(reqs, got, strict=True):
                self.points[(card, dataclasses.replace(r, seq_len=0))][r.seq_len] = t

    def form(self, card, shape) -> Callable[[int], object]:
        def at(seq_len: int):
            pts = self.points[(card, shape)]
            if not pts:  # one length first: enough to tell whether the states alone fit
                self.add(first=True)
            return pts[seq_len] if seq_len in pts else _quadratic(pts, seq_len)

        return at

    def __enter__(self) -> FittedTraces:
        """Registers the fitted forms and opens the trace workers' pool that every `add` shares;
        when the first lengths are not cached, its fork server starts loading torch now, while
        the search prices its first length."""
        from memfit.estimate.trace import trace

        first = [(c, [dataclasses.replace(s, seq_len=self.schedule(c)[0]) for s in self.shapes]) for c in self.cards]
        self._workers = trace.shared_workers(start=not trace.cached(first, self.settings.trace_cache))
        self._workers.__enter__()
        cache = str(self.settings.trace_cache)
        for card, shape in self.points:
            traced_mod.EXTRAPOLATED[(card, shape, cache)] = self.form(card, shape)
        return self

    def __exit__(self, *exc) -> None:
        cache = str(self.settings.trace_cache)
        for card, shape in self.points:
            traced_mod.EXTRAPOLATED.pop((card, shape, cache), None)
        self._workers.__exit__(*exc)


def _quadratic(points: dict[int, object], seq_len: int):
    """The LayerTrace at `seq_len` that the polynomial through the (up to) three traced lengths
    nearest it (in ratio) gives, measure by measure, in exact rational arithmetic."""
    from memfit.estimate.trace.trace import LayerTrace

    near = sorted(points, key=lambda n: abs(math.log(n / seq_len)))[:3]
    runs = {}
    for layers, measures in points[near[0]].runs.items():
        runs[layers] = {}
        for m in measures:
            value = Fraction(0)
            for i in near:
                term = Fraction(points[i].runs[layers][m])
                for j in near:
                    if j != i:
                        term *= Fraction(seq_len - j, i - j)
                value += term
            runs[layers][m] = round(value)
    first = points[near[0]]
    return LayerTrace(key={**first.key, "seq_len": int(seq_len), "fitted_from": sorted(near)}, runs=runs, seconds=0.0)


def _uses_traces(job: Job, cand: Candidate) -> bool:
    settings = job.settings
    return (settings.activations == "traced" or job.arch.generic) and not traced_mod.traced_fallback_reason(
        job.arch, cand, settings
    )


def _shapes(job: Job, cand: Candidate) -> list:
    """The trace shapes an estimate of `cand` reads: its own attention's, and SDPA's where an
    eager estimate prices its scores against a fused kernel (core._eager_attention_cost)."""
    shapes = [dataclasses.replace(traced_mod.trace_request(job.arch, cand, job.settings), seq_len=0)]
    sdpa = dataclasses.replace(cand, attn="sdpa")
    if cand.attn == "eager" and not model_problems(job.arch, sdpa):
        shapes.append(dataclasses.replace(traced_mod.trace_request(job.arch, sdpa, job.settings), seq_len=0))
    return list(dict.fromkeys(shapes))


def _step_line(what: str, value: int, est: Estimate) -> str:
    if est.invalid:
        return f"{what} {value:,}: invalid ({est.reason})"
    used = est.device_memory_bytes - est.margin_bytes
    usable = est.usable_device_bytes or est.device_memory_bytes
    verdict = "fits" if est.fits_with_headroom else "does not fit"
    host = f", host {est.host_bytes / GIB:,.1f} of {est.host_memory_bytes / GIB:,.1f} GiB"
    return f"{what} {value:,}: {verdict} (device {used / GIB:,.2f} of {usable / GIB:,.2f} GiB usable{host})"


def maximize(
    arch: ModelArch,
    gpu: GPU,
    num_gpus: int,
    num_nodes: int,
    method: str,
    cand: Candidate,
    what: str,
    bound: int | None,
    bound_label: str = "the search's bound",
    host_memory_gb: float | None = None,
    budget_bytes: int | None = None,
    settings: Settings = DEFAULT_SETTINGS,
    headroom: float = 0.0,
    say: Callable[[str], None] = lambda line: None,
    sweep: bool = True,
) -> Answer:
    """The largest `what` ("seq_len" or "micro_batch") in [smallest, bound] that fits with
    `headroom` kept free (bound None: up to memory, at most SEARCH_CAP); for seq_len also the
    longest at every sequence-parallel size the ranks and heads allow (`sweep`). `say` gets one
    line per search step."""
    if what not in ("seq_len", "micro_batch"):
        raise EstimateError(f"--maximize must be seq_len or micro_batch, got {what!r}")
    lo = MIN_SEQ_LEN if what == "seq_len" else method_shape(method).min_micro_batch
    if bound is not None and bound < lo:
        raise EstimateError(f"the search's bound {bound} is below the smallest {what}, {lo}")
    job = Job(_estimable(arch), gpu, num_gpus, num_nodes, method, host_memory_gb, budget_bytes, settings, headroom)

    def search(c: Candidate, prefix: str = "") -> tuple[int, Estimate]:
        def at(value: int) -> Estimate:
            e = _estimate(job, dataclasses.replace(c, **{what: value}))
            say(prefix + _step_line(what, value, e))
            if what != "seq_len" or not c.tiled_mlp or not e.fits_with_headroom:
                return e
            # the tiled MLP's memory is not monotonic in the length: a length counts as fitting
            # when every length below it does too, which the worst lengths below it decide
            for n in _tiled_worst_below(job, c, value, lo):
                w = _estimate(job, dataclasses.replace(c, seq_len=n))
                if not w.fits_with_headroom:
                    say(
                        f"{prefix}{_step_line(what, n, w)}, so {value:,} is not an answer (a shorter length does not fit)"
                    )
                    return dataclasses.replace(e, fits_with_headroom=False)
            return e

        return largest_fitting(at, lo, bound)

    if what != "seq_len" or not _uses_traces(job, cand):
        best, est = search(cand)
        sizes = sequence_parallel_sizes(job.arch, job.world) if (what == "seq_len" and sweep) else []
        swept = {sp: search(dataclasses.replace(cand, sequence_parallel=sp), f"SP={sp}: ")[0] for sp in sizes}
        return Answer(best, est, _limited(best, bound, bound_label), swept)

    from memfit.estimate.trace import trace

    answer = Answer(0, None, "memory")
    # every trace reports as it starts and ends (with its seconds) on the same `say`
    with trace.progress_to(say), FittedTraces(job.arch, _shapes(job, cand), settings, say) as traces:
        # the smallest length on the first traced length's activations (more than its own): when
        # the weights and states alone do not fit, nothing does, and no other length is traced
        probe = _estimate(job, dataclasses.replace(cand, seq_len=lo))
        if _short_without_activations(probe):
            say(_step_line(what, lo, probe))
            if not probe.invalid:
                probe.notes.append(
                    "nothing fits: the weights and states alone exceed the usable memory (the "
                    f"activations shown are those of {traces.lengths[0]:,} tokens, the shortest traced length)"
                )
            answer.estimate, answer.traced_lengths = probe, traces.lengths
            return answer
        traces.add()  # each kind's schedule
        best, est = _until_traced(search, traces, cand, lo, bound, say, answer.notes)
        answer.value, answer.estimate = best, est
        if sweep:
            for sp in sequence_parallel_sizes(job.arch, job.world):
                answer.sweep[sp] = search(dataclasses.replace(cand, sequence_parallel=sp), f"SP={sp}: ")[0]
        answer.traced_lengths = traces.lengths
    answer.limited_by = _limited(best, bound, bound_label)
    return answer


def _until_traced(search, traces, cand: Candidate, lo: int, bound: int | None, say, notes: list[str]):
    """Search on the traces' fitted form; below the traced lengths, trace the answer and the
    length above it for real and search again, until the answer stands on real traces (or
    MAX_ROUNDS, said in `notes`). Returns (best, its Estimate)."""
    for _ in range(MAX_ROUNDS):
        best, est = search(cand)
        if per_rank(dataclasses.replace(cand, seq_len=max(best, lo))).seq_len >= min(TRACE_LENGTHS):
            break  # at or beyond the traced lengths, where the quadratic holds
        if not best and _short_without_activations(est):
            break  # the weights and states alone do not fit: no trace changes that
        # the answer and the length above it, as the rank computes them, traced for real
        check = [best, best + 1] if best else [lo]
        if bound is not None:
            check = [n for n in check if n <= bound]
        lengths = {per_rank(dataclasses.replace(cand, seq_len=n)).seq_len for n in check}
        if traces.traced_everywhere(lengths):
            break
        say(f"checking {', '.join(f'{n:,}' for n in check)} with real traces")
        traces.add(lengths)
    else:
        notes.append(
            f"the answer comes from the traces' fitted form: after {MAX_ROUNDS} rounds the traced "
            "lengths still moved it"
        )
    return best, est


def _tiled_worst_below(job: Job, cand: Candidate, seq_len: int, lo: int) -> list[int]:
    """The lengths below `seq_len` that may need more memory than it with the tiled MLP, whose
    rows are padded to a multiple of its tiles, ceil(s / T) for s tokens a rank (T: the tile
    tokens; micro_step.mlp_tiles): a padded length adds a zero-filled gradient of the
    layer's input that a multiple of the tiles does not (seq_len - 1), and one tile more shrinks
    every tile's rows, so the last padded length before the tile count went up, (k - 1) * T - 1
    tokens a rank, has the largest tiles (activation_memory's 7dri + 2drh). Within a tile count
    memory grows with the length, so these and `seq_len` bound every length below it."""
    sp = cand.sequence_parallel
    tile = job.settings.mlp_tile_tokens or job.arch.hidden_size
    per_rank_len = -(-seq_len // sp)  # core.per_rank
    tiles = -(-per_rank_len // tile)
    worst = {seq_len - 1}
    if tiles >= 2:
        worst.add(((tiles - 1) * tile - 1) * sp)  # the longest whose rank holds (k - 1) * T - 1 tokens
    return sorted(n for n in worst if lo <= n < seq_len)


def _short_without_activations(est: Estimate) -> bool:
    """Whether the device is short even with the activation and logit terms taken out."""
    if est.invalid:
        return True
    rest = est.device_total_bytes - est.breakdown.get("activations", 0) - est.breakdown.get("logits", 0)
    return rest > (est.usable_device_bytes or est.device_memory_bytes)


def _limited(best: int, bound: int | None, label: str) -> str:
    if bound is not None and best == bound:
        return f"{label}: {bound}"
    if bound is None and best == SEARCH_CAP:
        return f"the search's cap: {SEARCH_CAP}"
    return "memory"
