"""DeepSpeed ALST's per-layer memory levers beside sequence parallelism: the tiled MLP and the
offload of checkpointed activations to the host (Bekman et al. 2025, "Arctic Long Sequence
Training", arXiv 2506.13996, sec. 3.3 and 3.4). DeepSpeed implements both; memfit writes the glue.

- **Tiled MLP** (`tile_mlps`): each decoder layer's MLP runs through
  `deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP`, which computes the MLP a tile of
  tokens at a time under no_grad, saves only its input, and recomputes each tile in the backward
  (setting `ds_grad_is_ready` so that ZeRO reduces a weight's gradient once, after the last tile).
  The intermediates (gate, up, act(gate) * up: 4 x intermediate_size per token) exist for one
  tile instead of the whole sequence. Tiles: ceil(seq / tile_tokens) per sequence, with
  tile_tokens = hidden_size by default (TiledMLP's docstring: `num_shards = ceil(seqlen / hidden)`),
  agreed over the ranks (the maximum: under ZeRO-3 every rank must gather the MLP's weights as
  many times). The glue hands TiledMLP the [tokens, hidden] rows padded to a multiple of the
  tile count, so that `torch.chunk` yields exactly that many tiles in forward and backward
  (TiledMLP marks the gradient ready at tile index `shards - 1`; fewer tiles would never reach
  it); the padded rows are zeros whose outputs are dropped, so no gradient comes from them.
- **Activation offload** (`activation_offload`): DeepSpeed's `CheckpointHiddenStatesOffload`
  (runtime/activation_checkpointing/offload_activations.py; a `saved_tensors_hooks` context)
  copies the input each checkpointed decoder layer keeps (transformers'
  GradientCheckpointingLayer, non-reentrant) to pinned host memory on a side stream, keeps the
  newest one on the device, and copies each back when its layer's backward needs it. It wraps a
  micro step's forward and backward. On a device without streams (DeepSpeed's CPU accelerator:
  the host is the device) DeepSpeed marks the inputs and skips every copy; `stats` says so.
"""

from __future__ import annotations

import contextlib
import functools
import math
import types

import torch

from memfit.space import Candidate
from memfit.train import dist as dist_env


def _decoder_layers(model) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def tile_count(tokens_per_sequence: int, tile_tokens: int) -> int:
    """Tiles of one MLP call, the same on every rank (the largest any rank needs): one scalar
    all-reduce per MLP call, as TiledMLP's docstring does it (on a GPU `.item()` waits for the
    stream, nothing next to the MLP of the sequences the tiling is for)."""
    n = max(1, math.ceil(tokens_per_sequence / tile_tokens))
    if dist_env.initialized() and dist_env.world() > 1:
        n = int(dist_env.all_reduce([n], "max")[0])
    return n


def _tiled_forward(mlp: torch.nn.Module, tile_tokens: int):
    """`mlp.forward` through DeepSpeed's TiledMLP (see the module docstring)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    plain = type(mlp).forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, hidden = x.shape, x.shape[-1]
        rows = x.reshape(-1, hidden)
        shards = tile_count(shape[-2] if x.dim() > 2 else rows.shape[0], tile_tokens)
        pad = -rows.shape[0] % shards
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, hidden)])
        params = [p for p in self.parameters() if p.requires_grad]
        out = TiledMLP.apply(plain, self, rows, shards, params)
        return (out[: out.shape[0] - pad] if pad else out).reshape(shape[:-1] + out.shape[-1:])

    return types.MethodType(forward, mlp)


def tile_mlps(model, tile_tokens: int | None = None) -> int:
    """Route every decoder layer's dense MLP through TiledMLP; the number of MLPs tiled.
    `tile_tokens`: tokens per sequence in a tile (None: the model's hidden size)."""
    tile = tile_tokens or int(model.config.hidden_size)
    tiled = 0
    for layer in _decoder_layers(model):
        mlp = getattr(layer, "mlp", None)
        if mlp is None:
            raise ValueError(f"tiled_mlp: {type(layer).__name__} has no .mlp to tile")
        if hasattr(mlp, "experts"):
            raise ValueError(
                f"tiled_mlp tiles dense MLPs; {type(mlp).__name__} routes tokens to experts (use tiled_mlp false)"
            )
        mlp.forward = _tiled_forward(mlp, tile)
        tiled += 1
    if not tiled:
        raise ValueError(f"tiled_mlp: {type(model).__name__} has no transformers decoder layers to tile")
    return tiled


def prepare(model, cand: Candidate, tile_tokens: int | None = None) -> str:
    """Apply the candidate's layer levers to a freshly loaded model (before deepspeed.initialize);
    what was done, for the log ("" when nothing)."""
    if not cand.tiled_mlp:
        return ""
    tile = tile_tokens or int(model.config.hidden_size)
    return f"tiled MLP: {tile_mlps(model, tile)} layers in tiles of {tile} tokens per sequence (DeepSpeed TiledMLP)"


def offload_summary(ctx) -> str:
    """One micro step of the activation offload, from DeepSpeed's own counters."""
    st = ctx.stats
    return (
        f"activation offload: {st.marked_tensors} checkpointed inputs marked, {st.offloaded_tensors} moved to "
        f"the host ({st.offloaded_bytes / 2**20:,.1f} MiB), {st.skipped_marked_tensors} skipped"
        + (" (a device without streams: the host is the device)" if st.skipped_marked_tensors else "")
    )


@functools.cache
def _offload_class():
    """DeepSpeed's CheckpointHiddenStatesOffload with its marks keyed by the tensor's memory
    (storage, offset, shape) instead of its Python identity. DeepSpeed 0.19.8 marks the decoder
    layer's `hidden_states` argument by `id()` and offloads it when the checkpoint's saved-tensor
    hook packs an object with that id; under ZeRO-3 the argument is the output of ZeRO-3's
    `PreBackwardFunctionForModule` and autograd hands the hook another Python object over the
    same memory, so no mark matched and nothing was offloaded (measured: 4 of 4 inputs marked, 0
    packed, on the demo model at ZeRO-3; 4 of 4 at ZeRO-2). The same tensors, found by memory."""
    from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload

    def key(t: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
        return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)

    class ByMemory(CheckpointHiddenStatesOffload):
        def mark(self, tensor: torch.Tensor) -> None:
            self._allowed[key(tensor)] = self._allowed.get(key(tensor), 0) + 1
            self.stats.marked_tensors += 1

        def _consume_mark(self, tensor: torch.Tensor) -> bool:
            k = key(tensor)
            count = self._allowed.get(k, 0)
            if count <= 0:
                return False
            if count == 1:
                del self._allowed[k]
            else:
                self._allowed[k] = count - 1
            return True

    return ByMemory


def activation_offload(cand: Candidate) -> contextlib.AbstractContextManager:
    """The context one micro step's forward and backward run in: DeepSpeed's offload of the
    checkpointed layer inputs (pinned host buffers, its defaults), or nothing."""
    return _offload_class()() if cand.activation_offload else contextlib.nullcontext()
