"""Traced activation memory: a real transformers training step on fake tensors, per layer.

    from memfit.estimate.models import catalog
    from memfit.estimate.trace import trace
    t = trace.layer_trace(catalog.model("qwen2.5-72b"), seq_len=4096, attn="sdpa",
                          precision="bf16", grad_ckpt=True, finetune="full")
    t.saved(num_layers=80, batch=2)   # bytes autograd keeps after the forward, 80 layers, b=2

Where the analytic activation formulas (memfit.estimate.activations) are weak (a new
architecture, an attention variant, peft's adapters), this runs the model's own code instead
(the run itself: memfit.estimate.trace.trace_step; this module keys, caches and batches the runs). The model is built
from the architecture card (`ModelArch.to_hf_config()`, i.e. the config.json fields) with
`num_hidden_layers` reduced to 1 and to 2, under `torch._subclasses.fake_tensor.FakeTensorMode`
(fake CPU tensors: shapes and dtypes without storage, so a 72B layer at 8k tokens costs no
memory and well under a second), and one forward + loss + backward (of 2 and of 3 sequences) is measured
with PyTorch's `torch.distributed._tools.mem_tracker.MemTracker` (a TorchDispatchMode that
attributes every storage to PARAM/BUFFER/GRAD/ACT/TEMP/OPT and keeps per-module snapshots at
pre/post forward, pre/post backward and the peak of each: mem_tracker.py `_ModState`).

What each run measures (bytes of everything that is not a parameter or a buffer):
  - `fwd_peak`: the peak through the model forward and the loss forward;
  - `pre_loss`: live after the model forward (the logits included), `logits_bytes` their size;
  - `saved`: live after the loss forward once the model output is dropped (as train.py `loss`
    does): what autograd keeps for the backward;
  - `loss_bwd_peak`: the peak inside the loss's backward, until the head's backward starts;
  - `top_pre_bw`, `top_peak_bw`, `top_mlp_peak_bw`, `top_attn_peak_bw`: the top decoder layer's
    snapshot when its backward starts and the peaks inside it, its MLP and its attention;
  - `bottom_peak_bw`: the peak inside the bottom layer's backward.
  With gradient checkpointing the top layer's peak includes its recomputed forward.
Parameter gradients are dropped as soon as they are accumulated (a post-accumulate-grad hook),
so the peaks are the activation side; the estimate adds the gradients the ZeRO stage keeps.

Four runs: 1 and 2 decoder layers, each with 2 and 3 sequences. The 2-layer minus the 1-layer
model is the per-layer term; the 1-layer model minus it the embedding/final-norm/logits/loss
term. What is alive at any moment of the step is affine in the number of sequences (every
saved tensor has a batch dimension; tests/test_trace.py checks 2, 3 and 4 sequences), so the
3-sequence minus the 2-sequence run, moment by moment, is the per-sequence activation memory,
and the estimate multiplies it by the sequences of a micro step; what does not grow with the
batch (a weight gradient alive at a peak, the rotary table) is left to the estimate's own
terms (see `per_sequence`).

Mappings, stated: FlashAttention-2 cannot run on the CPU; it is traced as SDPA, whose CPU kernel
(`_scaled_dot_product_flash_attention_for_cpu`) keeps the same tensors as FlashAttention-2 (the
output and the fp32 log-sum-exp; Dao 2023, FlashAttention-2, Algorithm 2). QLoRA's bitsandbytes
kernels need CUDA; QLoRA is traced as LoRA (the adapters' and the layers' saved activations are
the same; the 4-bit weight is dequantized transiently per matmul).

Results are cached as JSON, one file per (architecture fields, transformers/torch/peft versions,
sequence length, attention, precision, checkpointing, finetune, LoRA rank/targets), in
`cache_dir`, else $MEMFIT_TRACE_CACHE, else ~/.cache/memfit/traces; written atomically
(temporary file + os.replace).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.atomic import write_json_atomic
from memfit.estimate.errors import TraceError
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.trace.trace_children import (  # noqa: F401 - progress_to, shared_workers, trace_workers: API
    ENV_IN_PROCESS,
    TRACE_LAYERS,
    _trace_in_children,
    progress_to,
    reporter,
    shared_workers,
    trace_workers,
)
from memfit.estimate.trace.trace_step import MEASURES  # defined with the step that measures them

TRACE_FORMAT = 7  # bump when what a trace measures changes (old cache files are then ignored)
ENV_CACHE = "MEMFIT_TRACE_CACHE"
# ModelArch fields that do not change one sequence's activations (names, provenance, the layer
# count the trace replaces, position limit: rotary tables are built per forward for the actual
# positions, modeling_rope_utils; the vision tower is not in the text model).
_NOT_IN_KEY = {
    "name",
    "source",
    "hf_repo",
    "aliases",
    "num_layers",
    "max_position_embeddings",
    "vision_params",
    "score_head",  # a reward model is traced as its causal LM (traced.traced_activations swaps the head's terms)
}
# The sizes the traced model is built from: ModelArch's required integer fields (the card's
# sizes; catalog._required names the same fields without a default), less those the trace
# replaces (num_layers: 1 and 2) or does not use (max_position_embeddings).
_REQUIRED = tuple(
    f.name
    for f in dataclasses.fields(ModelArch)
    if f.default is dataclasses.MISSING and f.type in ("int", int) and f.name not in _NOT_IN_KEY
)

_MEMO: dict[str, LayerTrace] = {}  # in-process cache over the JSON files (key hash -> trace)
_FAST: dict[tuple, LayerTrace] = {}  # (arch, request, cache dir) -> trace, over _MEMO


def default_cache_dir() -> Path:
    env = os.environ.get(ENV_CACHE)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "memfit" / "traces"


def traced_attn(attn: str) -> str:
    """The attention implementation the CPU trace runs for a candidate's `attn`."""
    if attn not in ("flash", "sdpa", "eager"):
        raise TraceError(f"attention must be flash, sdpa or eager, got {attn!r}")
    return "sdpa" if attn == "flash" else attn


def traced_finetune(finetune: str) -> str:
    if finetune not in ("full", "lora", "qlora"):
        raise TraceError(f"finetune must be full, lora or qlora, got {finetune!r}")
    return "lora" if finetune == "qlora" else finetune


@dataclass(frozen=True)
class LayerTrace:
    """Per-sequence measures (`per_sequence`) of the 1- and 2-layer models, and what they
    imply for L layers and b sequences."""

    key: dict[str, Any]
    runs: dict[str, dict[str, int]]  # "1", "2" layers -> MEASURES per sequence (bytes)
    seconds: float  # wall time of the traced runs when they were made

    def seq(self, name: str, layers: int) -> int:
        """Bytes of `name` per sequence in the `layers`-layer model."""
        return self.runs[str(layers)][name]

    def at(self, name: str, num_layers: int, batch: int = 1) -> int:
        """`name` for `num_layers` layers and `batch` sequences: per-layer terms are the
        2-layer minus the 1-layer run; the rest is the 1-layer run minus one layer."""
        one, two = self.seq(name, 1), self.seq(name, 2)
        return batch * (one + (num_layers - 1) * (two - one))

    def per_layer(self, name: str, batch: int = 1) -> int:
        return batch * (self.seq(name, 2) - self.seq(name, 1))

    def saved(self, num_layers: int, batch: int = 1) -> int:
        return self.at("saved", num_layers, batch)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "runs": self.runs,
            "seconds": self.seconds,
        }


@dataclass(frozen=True)
class MixedTrace:
    """A model whose decoder layers differ (memfit.estimate.models.generic.layer_groups): one LayerTrace
    per kind of layer and how many of it, read as LayerTrace is. A measure at L layers puts each
    kind on top in turn, every other layer below it adding its own kind's per-layer increment,
    and keeps the largest; per-layer and per-sequence terms are the largest kind's."""

    groups: tuple[tuple[int, LayerTrace], ...]

    def seq(self, name: str, layers: int) -> int:
        return max(t.seq(name, layers) for _, t in self.groups)

    def per_layer(self, name: str, batch: int = 1) -> int:
        return max(t.per_layer(name, batch) for _, t in self.groups)

    def at(self, name: str, num_layers: int, batch: int = 1) -> int:
        if num_layers != sum(n for n, _ in self.groups):
            raise ValueError(f"a mixed trace of {sum(n for n, _ in self.groups)} layers asked for {num_layers}")

        def on_top(k: int) -> int:
            below = sum((n - (j == k)) * t.per_layer(name) for j, (n, t) in enumerate(self.groups))
            return self.groups[k][1].seq(name, 1) + below

        return batch * max(on_top(k) for k in range(len(self.groups)))

    def saved(self, num_layers: int, batch: int = 1) -> int:
        return self.at("saved", num_layers, batch)


def trace_key(
    arch: ModelArch,
    seq_len: int,
    attn: str,
    precision: str,
    grad_ckpt: bool,
    finetune: str,
    lora_rank: int = 16,
    lora_targets: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """Everything a trace's numbers depend on (hashed into the cache file name)."""
    _check(arch)
    if precision not in ("bf16", "fp16", "fp32"):
        raise TraceError(f"precision must be bf16, fp16 or fp32, got {precision!r}")
    if seq_len < 2:
        raise TraceError(f"seq_len must be >= 2 (next-token loss), got {seq_len}")
    ft = traced_finetune(finetune)
    # as JSON gives it back (tuples as lists), so a cache file's key compares equal
    arch_fields = json.loads(json.dumps({k: v for k, v in dataclasses.asdict(arch).items() if k not in _NOT_IN_KEY}))
    return {
        "format": TRACE_FORMAT,
        "arch": arch_fields,
        "versions": _versions(),
        "seq_len": int(seq_len),
        "micro_batch": 1,
        "attn": traced_attn(attn),
        "precision": precision,
        "grad_ckpt": bool(grad_ckpt),
        "finetune": ft,
        "lora_rank": int(lora_rank) if ft != "full" else 0,
        "lora_targets": list(lora_targets) if (ft != "full" and lora_targets) else None,
    }


@functools.lru_cache(maxsize=1)
def _versions() -> dict[str, str]:
    # from the installed distributions' metadata: no need to import torch to read a cache hit
    from importlib.metadata import version

    return {p: version(p) for p in ("torch", "transformers", "peft")}


def _hash(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class TraceRequest:
    """One shape to trace: the trace_key arguments besides the architecture."""

    seq_len: int
    attn: str
    precision: str
    grad_ckpt: bool
    finetune: str
    lora_rank: int = 16
    lora_targets: tuple[str, ...] | None = None


def layer_trace(
    arch: ModelArch,
    seq_len: int,
    attn: str,
    precision: str,
    grad_ckpt: bool,
    finetune: str,
    lora_rank: int = 16,
    lora_targets: tuple[str, ...] | None = None,
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
) -> LayerTrace:
    """The cached trace for this shape, tracing (1 and 2 layers) on a miss."""
    req = TraceRequest(seq_len, attn, precision, grad_ckpt, finetune, lora_rank, lora_targets)
    d = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    fast = (arch, req, str(d))  # estimate_space asks thousands of times: skip key and hash
    if use_cache and fast in _FAST:
        return _FAST[fast]
    t = layer_traces(arch, [req], cache_dir=d, use_cache=use_cache)[0]
    if use_cache:
        _FAST[fast] = t
    return t


def layer_traces(
    arch: ModelArch,
    requests: list[TraceRequest],
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
    progress: Callable[[str], None] | None = None,
    workers: int | None = None,
) -> list[LayerTrace]:
    """Traces for several shapes of one architecture: cached ones from the cache, the missing
    ones traced in child processes (trace_children: trace_workers() of them, forked from a
    server that imported torch, transformers and peft once), which keep the estimating process
    clean of fake tensors. `progress`: where the progress lines go (default: the
    innermost `progress_to`); `workers`: at most this many children (default trace_workers())."""
    return layer_traces_of_kinds([(arch, requests)], cache_dir, use_cache, progress, workers)[0]


def layer_traces_of_kinds(
    batches: list[tuple[ModelArch, list[TraceRequest]]],
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
    progress: Callable[[str], None] | None = None,
    workers: int | None = None,
) -> list[list[LayerTrace]]:
    """`layer_traces` of several architectures (a mixed model's kinds of layer:
    generic.layer_groups) at once: every missing shape on one pool of workers, submitted in the
    order given (the caller's longest first), so a worker free of one kind's shapes takes the
    next kind's."""
    d = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    found, missing = [], []  # per batch: the traces in order; {hash: index} of those to trace
    for arch, requests in batches:
        keys = [
            trace_key(arch, r.seq_len, r.attn, r.precision, r.grad_ckpt, r.finetune, r.lora_rank, r.lora_targets)
            for r in requests
        ]
        out: list[LayerTrace | None] = [None] * len(requests)
        todo: dict[str, int] = {}
        for i, key in enumerate(keys):
            h = _hash(key)
            hit = _load(d, h, key) if use_cache else None
            if hit is not None:
                out[i] = hit
            elif h not in todo:
                todo[h] = i
        found.append((keys, out))
        missing.append(todo)
    traced = [(b, todo) for b, todo in enumerate(missing) if todo]
    if traced:
        fresh = _trace_in_children(
            [(batches[b][0], [found[b][0][i] for i in todo.values()]) for b, todo in traced],
            reporter(progress),
            workers,
        )
        for (b, todo), results in zip(traced, fresh, strict=True):
            keys, out = found[b]
            for (h, i), (runs, secs) in zip(todo.items(), results, strict=True):
                t = LayerTrace(key=keys[i], runs=runs, seconds=secs)
                if use_cache:
                    write_json_atomic(d / f"{h}.json", t.to_json())
                    _MEMO[f"{d.resolve()}/{h}"] = t
                out[i] = t
            for i, key in enumerate(keys):
                if out[i] is None:  # a duplicate of a request traced just now
                    out[i] = out[todo[_hash(key)]]
    return [[t for t in out if t is not None] for _, out in found]


def cached(batches: list[tuple[ModelArch, list[TraceRequest]]], cache_dir: str | Path | None = None) -> bool:
    """Whether every shape of every batch is in the cache (a model that cannot be traced: False,
    and `layer_traces` says why)."""
    d = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    try:
        return all(
            _load(d, _hash(k), k) is not None
            for arch, requests in batches
            for r in requests
            for k in [
                trace_key(arch, r.seq_len, r.attn, r.precision, r.grad_ckpt, r.finetune, r.lora_rank, r.lora_targets)
            ]
        )
    except TraceError:
        return False


def _load(d: Path, h: str, key: dict[str, Any]) -> LayerTrace | None:
    memo_key = f"{d.resolve()}/{h}"
    if memo_key in _MEMO:
        return _MEMO[memo_key]
    path = d / f"{h}.json"
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        if raw.get("key") != key:
            return None
        t = LayerTrace(
            key=key,
            runs={str(n): {m: int(raw["runs"][str(n)][m]) for m in MEASURES} for n in TRACE_LAYERS},
            seconds=float(raw.get("seconds", 0.0)),
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None  # a corrupt or foreign file: traced again and overwritten
    _MEMO[memo_key] = t
    return t


def clear_memo() -> None:
    """Forget the in-process copies (the JSON files stay)."""
    _MEMO.clear()
    _FAST.clear()


def _check(arch: ModelArch) -> None:
    missing = [f for f in _REQUIRED if not isinstance(getattr(arch, f, None), int) or getattr(arch, f) <= 0]
    if missing:
        raise TraceError(
            f"model {arch.name!r}: config lacks {', '.join(missing)}; the traced path builds the "
            f"model from these fields"
        )
