"""One traced training step on fake tensors: the model as memfit's trainer builds it, one
forward + loss + backward under PyTorch's MemTracker, and the measures memfit.estimate.trace.trace caches
(`per_sequence`; what each measure means: memfit.estimate.trace.trace's docstring).

Runs in memfit.estimate.trace.trace's worker processes (memfit.estimate.trace.trace_worker); torch, transformers and peft
are imported here only, lazily.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from memfit.estimate.errors import TraceError
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.models.fake_mode import grouped_mm_for_fake
from memfit.estimate.trace.trace_model import build_model

# What one traced step records, per sequence, in bytes (memfit.estimate.trace.trace's docstring says what each is).
MEASURES = (
    "fwd_peak",
    "pre_loss",
    "logits_bytes",
    "saved",
    "loss_bwd_peak",
    "top_pre_bw",
    "top_peak_bw",
    "top_mlp_peak_bw",
    "top_attn_peak_bw",
    "bottom_peak_bw",
    # FLOPs (memfit.estimate.trace.trace_flops), not bytes: the model forward, and the whole step
    # (forward, loss, backward; with checkpointing the recomputed forward too); of them the
    # attention kernels'; and the bytes every kernel but the matmuls and attention reads and
    # writes (memfit.estimate.time.roofline prices them)
    "fwd_flops",
    "flops",
    "fwd_attn_flops",
    "attn_flops",
    "fwd_mem_bytes",
    "mem_bytes",
)
_FLOPS = MEASURES[MEASURES.index("fwd_flops") :]


class _NoHandle:
    def remove(self) -> None:
        pass


def _series_tracker_class():
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class SeriesTracker(MemTracker):
        """MemTracker that also keeps the activation-side total after every op (`series`) and
        where each module's backward starts in it (`marks`)."""

        def __init__(self, device) -> None:
            super().__init__()
            self.device = device
            self.series: list[int] = []
            self.marks: dict[int, int] = {}

        def act(self, snap: dict) -> int:
            s = snap.get(self.device, {})
            kinds = (_MemRefType.ACT, _MemRefType.TEMP, _MemRefType.GRAD)
            return int(sum(s.get(r, 0) for r in kinds))

        def _update_peak_stats(self, peak_state) -> None:
            # replaces MemTracker's per-op deepcopy of a snapshot for every active module (a
            # third of a traced run); the peaks are taken from `series` instead
            self.series.append(self.act(self._curr_mem_snap))

        def _pre_bw_hook(self, module, args) -> None:
            super()._pre_bw_hook(module, args)
            if module is not None:
                self.marks.setdefault(id(module), len(self.series))

        def peak(self, start: int, end: int) -> int:
            window = self.series[start:end]
            return max(window) if window else 0

    return SeriesTracker


def _SeriesTracker(device):
    return _series_tracker_class()(device)


def _not_packed(position_ids):
    return None


_PEAKS = {  # peak measure -> its window of the op series
    "fwd_peak": "forward",
    "loss_bwd_peak": "loss",
    "top_peak_bw": "top",
    "top_mlp_peak_bw": "mlp",
    "top_attn_peak_bw": "attn",
    "bottom_peak_bw": "bottom",
}


def per_sequence(arch: ModelArch, **shape: Any) -> dict[str, int]:
    """MEASURES per sequence: the 3-sequence run minus the 2-sequence run, moment by moment.
    `shape`: `_run`'s keyword arguments besides the micro batch.

    The two runs execute the same ops in the same order (checked), and what is alive at any
    one moment is affine in the number of sequences (tests/test_trace.py checks 2, 3, 4), so
    the difference at each moment is that moment's per-sequence bytes and a peak's
    per-sequence value is the largest of those over its window. What does not scale with the
    batch drops out: a weight's gradient alive at a peak, a tied embedding's head gradient
    (autograd's input buffer holds it until the embedding's backward adds its share:
    torch/csrc/autograd/input_buffer.cpp), the rotary cos/sin table; the estimate counts
    gradients and the rotary table in its own terms."""
    # 2 and 3 sequences: a batch of one runs a slightly different op sequence (a couple of ops
    # fewer in transformers' Llama/Qwen2), which would misalign the moment-by-moment difference
    for shrink in (False, True):  # one kind of layer of a mixed model: see _keep_layers
        try:
            m1, s1, w1 = _run(arch, micro_batch=2, shrink_config=shrink, **shape)
            m2, s2, w2 = _run(arch, micro_batch=3, shrink_config=shrink, count_flops=False, **shape)
            break
        except (IndexError, RuntimeError):
            if shrink or not arch.layer_kind:
                raise
    if len(s1) != len(s2) or w1 != w2:
        raise TraceError(
            f"model {arch.name!r}: the traced step runs different ops for 2 and 3 sequences "
            f"({len(s1)} vs {len(s2)}); its activations cannot be split per sequence"
        )
    diff = [b - a for a, b in zip(s1, s2, strict=True)]
    out = {m: m2[m] - m1[m] for m in MEASURES if m not in _PEAKS}
    # FLOPs are linear in the sequences (every matmul and attention scales with the batch; the
    # rotary table's few FLOPs do not), so they are counted in the 2-sequence run only: the FLOP
    # run is a third of a trace's time (profile of qwen3.5-27b's cold estimate, 2026-11-26).
    # The element-wise bytes are per token too, but for the embedding's V x h gradient, written
    # once per step: halved here, it is counted b / 2 times for b sequences (about 1% of a
    # 2,048-token sequence's bytes on Llama-3.1-8B)
    out.update({m: m1[m] // 2 for m in _FLOPS})
    for m, w in _PEAKS.items():
        lo, hi = w1[w]
        out[m] = max(diff[lo:hi]) if hi > lo else 0
    return out


def _sft_loss_module():
    import torch

    from memfit.train.losses import token_logps

    class _Loss(torch.nn.Module):
        """memfit's SFT loss (losses.sft_loss) as a module so MemTracker records its backward.
        The token count is a Python number here: sft_loss's int(mask.sum()) reads data, which
        fake tensors have not, and allocates nothing that matters."""

        def forward(self, logits, labels):
            logps, _ = token_logps(logits, labels)
            return -logps.sum() / max(labels.numel() - labels.shape[0], 1)

    return _Loss()


def _decoder_layers(model, arch: ModelArch, num_layers: int):
    from memfit.estimate.models.inventory import decoder_layers

    # peft wraps the model (base_model.model...); the list of num_layers layers is found the same
    _, layers = decoder_layers(model, num_layers)
    if layers is None or len(layers) != num_layers:
        raise TraceError(
            f"model {arch.name!r}: no ModuleList of {num_layers} decoder layers to trace (its config's "
            f"num_hidden_layers does not set the depth of its largest stack of layers)"
        )
    return layers


def _drop_gradients(model) -> None:
    """Drop each parameter's gradient once accumulated: the peaks measured are the activation
    side (the estimate adds the gradients the ZeRO stage keeps)."""
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))


def _track(model, device):
    """A series tracker following `model`'s modules."""
    tracker = _SeriesTracker(device)
    # MemTracker registers a gradient hook on every parameter it meets (mem_tracker.py
    # `_track_module_params_and_buffers`), which fails on frozen ones (LoRA's base weights)
    # and would count the gradients we drop; a placeholder handle per parameter stops it.
    for p in model.parameters():
        tracker._param_to_grad_hook_handles[p] = (_NoHandle(), _NoHandle())
    tracker.track_external(model)
    return tracker


def _step(model, tracker, ids, labels, loss_module) -> dict[str, int]:
    """One forward + loss + backward under `tracker`; the forward-side measures and where the
    backward starts in the op series (`bw_start`)."""
    from unittest import mock

    from transformers import masking_utils

    act = tracker.act
    with tracker:
        # One unpadded sequence per row. transformers decides from tensor values whether
        # SDPA may use is_causal instead of a materialised [b, 1, s, s] mask: padding_mask.all()
        # (masking_utils `_ignore_causal_mask_sdpa`) and "are the position ids one packed
        # sequence" (`find_packed_sequence_indices`); on fake tensors it cannot read them
        # and keeps the mask, and with a mask SDPA also repeats the GQA keys and values
        # (integrations/sdpa_attention.py `use_gqa_in_sdpa`). So no attention mask is passed
        # (what all-ones means) and the packing check answers what it answers on a real
        # unpadded batch: not packed.
        with mock.patch.object(masking_utils, "find_packed_sequence_indices", _not_packed):
            logits = model(input_ids=ids, use_cache=False).logits
        pre_loss = act(tracker.get_tracker_snapshot())
        logits_bytes = logits.numel() * logits.element_size()
        loss = loss_module(logits, labels)
        del logits
        saved = act(tracker.get_tracker_snapshot())
        bw_start = len(tracker.series)
        fwd_peak = tracker.peak(0, bw_start)
        loss.backward()
        del loss
    return {
        "fwd_peak": fwd_peak,
        "pre_loss": pre_loss,
        "logits_bytes": int(logits_bytes),
        "saved": saved,
        "bw_start": bw_start,
    }


def _count_flops(model, ids, labels, loss_module) -> dict[str, int]:
    """The FLOPs and bytes of the same step (trace_flops), forward and whole step, in a run of its
    own: a second dispatch mode inside MemTracker's would change what MemTracker attributes."""
    from unittest import mock

    from transformers import masking_utils

    from memfit.estimate.trace.trace_flops import counter

    flops = counter()
    with flops, mock.patch.object(masking_utils, "find_packed_sequence_indices", _not_packed):
        logits = model(input_ids=ids, use_cache=False).logits
        fwd = flops.measures()
        loss = loss_module(logits, labels)
        del logits
        loss.backward()
    step = flops.measures()
    return {**{f"fwd_{k}": int(v) for k, v in fwd.items()}, **{k: int(v) for k, v in step.items()}}


def _backward_windows(model, tracker, layers, bw_start: int) -> dict[str, tuple[int, int]]:
    """Windows of the backward's op sequence, cut where a module's backward starts
    (MemTracker's per-module PEAK_BW needs the module's post-backward hook, which under
    checkpointing does not fire for submodules: their forward inputs are not in the recomputed
    graph). Backward order in a decoder layer: MLP, post-attention norm, attention, input norm;
    the layer below (or the embedding) starts after it."""
    n = len(tracker.series)
    num_layers = len(layers)
    top, bottom = layers[num_layers - 1], layers[0]
    below = layers[num_layers - 2] if num_layers > 1 else model.get_input_embeddings()

    def mark(mod, default: int) -> int:
        return tracker.marks.get(id(mod), default) if mod is not None else default

    end_top = mark(below, n)
    m_top = mark(top, end_top)
    m_mlp = mark(getattr(top, "mlp", None), m_top)
    m_att = mark(getattr(top, "self_attn", None), end_top)
    m_head = mark(model.get_output_embeddings(), n)
    end_bottom = mark(model.get_input_embeddings(), n)
    return {
        "forward": (0, bw_start),
        "loss": (bw_start, m_head),
        "top": (m_top, end_top),
        "mlp": (m_mlp, m_att),
        "attn": (m_att, end_top),
        "bottom": (mark(bottom, end_bottom), end_bottom),
    }


def _run(
    arch: ModelArch,
    num_layers: int,
    seq_len: int,
    attn: str,
    precision: str,
    grad_ckpt: bool,
    finetune: str,
    lora_rank: int = 16,
    lora_targets: tuple[str, ...] | None = None,
    micro_batch: int = 1,
    fake: bool = True,
    shrink_config: bool = False,
    count_flops: bool = True,
) -> tuple[dict[str, int], list[int], dict[str, tuple[int, int]]]:
    """run_trace's measures, the activation-side total after every op, and the windows
    (`count_flops=False`: the FLOP measures are 0, not counted)."""
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import _ModState

    # fake=False runs the same step on real tensors (small models only): a check of the fake run
    with FakeTensorMode() if fake else contextlib.nullcontext(), grouped_mm_for_fake(fake):
        model = build_model(
            arch, num_layers, attn, precision, grad_ckpt, finetune, lora_rank, lora_targets, shrink_config
        )
        layers = _decoder_layers(model, arch, num_layers)
        loss_module = _sft_loss_module()
        _drop_gradients(model)
        ids = torch.randint(0, arch.vocab_size, (micro_batch, seq_len))
        labels = ids.clone()
        tracker = _track(model, torch.device("cpu"))
        forward = _step(model, tracker, ids, labels, loss_module)
        windows = _backward_windows(model, tracker, layers, forward.pop("bw_start"))
        top = layers[num_layers - 1]
        snaps = (
            tracker.memory_tracking[top].snapshots.get(_ModState.PRE_BW, []) if top in tracker.memory_tracking else []
        )
        out = {
            **forward,
            "loss_bwd_peak": tracker.peak(*windows["loss"]),
            "top_pre_bw": tracker.act(snaps[-1]) if snaps else 0,
            "top_peak_bw": tracker.peak(*windows["top"]),
            "top_mlp_peak_bw": tracker.peak(*windows["mlp"]),
            "top_attn_peak_bw": tracker.peak(*windows["attn"]),
            "bottom_peak_bw": tracker.peak(*windows["bottom"]),
            **(_count_flops(model, ids, labels, loss_module) if count_flops else dict.fromkeys(_FLOPS, 0)),
        }
    return out, tracker.series, windows


TRACE_LAYERS = (1, 2)  # per-layer = 2 layers - 1 layer (memfit.estimate.trace.trace.LayerTrace)


def trace_keys(
    arch: ModelArch, keys: list[dict[str, Any]], each: Callable[[int, dict[str, Any]], None] = lambda i, r: None
) -> list[dict[str, Any]]:
    """Trace each key (1 and 2 layers, TRACE_LAYERS): [{"runs": {layers: MEASURES}, "seconds": s}, ...];
    `each(i, result)` as each is done."""
    res = []
    for key in keys:
        t0 = time.perf_counter()
        runs = {
            str(n): per_sequence(
                arch,
                num_layers=n,
                seq_len=key["seq_len"],
                attn=key["attn"],
                precision=key["precision"],
                grad_ckpt=key["grad_ckpt"],
                finetune=key["finetune"],
                lora_rank=key["lora_rank"] or 16,
                lora_targets=tuple(key["lora_targets"]) if key["lora_targets"] else None,
            )
            for n in TRACE_LAYERS
        }
        res.append({"runs": runs, "seconds": time.perf_counter() - t0})
        each(len(res) - 1, res[-1])
    return res
