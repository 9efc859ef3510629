"""ZeRO-3's parameters on one rank beyond its partition: the optimizer's sub-groups
(`zero3_subgroups`, stage3.py `_create_fp16_sub_groups`) and the parameters DeepSpeed keeps
gathered during a step (`zero3_gathered_bytes`: the modules in use, those kept for reuse, the
prefetched; stage3's parameter coordinator replayed). memfit.estimate.memory.states counts them
into the ZeRO-3 model states."""

from __future__ import annotations

import functools

from memfit.estimate.models.arch import ModelArch
from memfit.estimate.models.params import fused_expert_weights, param_layout
from memfit.estimate.settings import Settings, dtype_bytes
from memfit.space import Candidate


@functools.lru_cache(maxsize=1024)
def zero3_subgroups(arch: ModelArch, world: int, sub_group_size: int) -> tuple[int, ...]:
    """Numel of each ZeRO-3 optimizer sub-group on one rank.

    stage3.py `_create_fp16_sub_groups`: parameters (their partition_numel, ceil(numel/world))
    are appended in module order until the running sum reaches sub_group_size."""
    layout = param_layout(arch)
    order = [layout.embed]
    if layout.order:  # read from transformers: the module order itself
        order = list(layout.order)
    elif layout.layers:  # MoE: dense and MoE layers differ
        order += [n for tensors in layout.layers for n in tensors]
    else:
        order += list(layout.layer_tensors) * arch.num_layers
    if not layout.order:
        order += [arch.hidden_size] + ([layout.lm_head] if layout.lm_head else [])
    parts = [-(-n // world) for n in order]
    if sum(parts) <= sub_group_size:
        return (sum(parts),)
    groups, running = [], 0
    for p in parts:
        running += p
        if running >= sub_group_size:
            groups.append(running)
            running = 0
    if running:
        groups.append(running)
    return tuple(groups)


def prefetch_bucket_elements(arch: ModelArch, settings: Settings) -> int:
    """stage3_prefetch_bucket_size: 0.9*h*h when scaled (HF "auto"), else DeepSpeed's 5e7."""
    if settings.stage3_prefetch_bucket_size is not None:
        return settings.stage3_prefetch_bucket_size
    return int(0.9 * arch.hidden_size**2) if settings.scaled_buckets else 50_000_000


def _zero3_layer_units(arch: ModelArch, layer: int) -> list[tuple[int, bool]]:
    """(numel, 4-bit quantizable) of each module of a decoder layer that ZeRO-3 gathers as one
    unit (DeepSpeed fetches a module's own parameters: `iter_params(module, recurse=False)`), in
    forward order. Norms and biases are below the persistence threshold (`ds_persist`: never
    partitioned) and are left out."""
    layout = param_layout(arch)
    if layout.units:  # read from transformers: each module that owns parameters
        return list(layout.units[layer])
    units = [(i * o, True) for _, i, o in layout.layer_linear_shapes(arch, layer)]
    if arch.is_moe and not arch.dense_layer_mask >> layer & 1:
        fan_in, fan_out = arch.router_shape()
        units.append((fan_in * fan_out, False))  # the router: a plain parameter, not quantized
        # the routed experts: one module holding both 3D parameters (`param_layout`), 4-bit
        # under memfit's QLoRA (memfit.train.qlora_experts)
        units.append((arch.num_experts * arch.expert_params(), bool(fused_expert_weights(arch))))
    return units


def zero3_gathered_bytes(arch: ModelArch, cand: Candidate, settings: Settings, forward_only: bool = False) -> int:
    """Peak bytes of gathered (unpartitioned) parameters on a rank during a ZeRO-3 step.

    DeepSpeed does not release a module's gathered parameters after use when the module is used
    again within `stage3_max_reuse_distance` elements of later fetches (runtime/zero/
    partitioned_param_coordinator.py `__params_to_release`: walks `__submodule_order[step_id:]`
    summing `ds_numel` and keeps every parameter it meets before the sum reaches the distance),
    and prefetches up to `stage3_prefetch_bucket_size` elements ahead while fewer than
    `stage3_max_live_parameters` are gathered (`fetch_sub_module`). With gradient checkpointing
    a layer's modules are used in its recompute and again in its backward, so the MLP of a 70B
    layer stays gathered across its backward; a model smaller than the distance keeps all its
    parameters gathered once the trace is complete (step 2 on): measured with DeepSpeed 0.19.8 on
    2 CPU ranks, a 3M-parameter Llama held 2,982,144 of its 2,984,448 elements at the top layer's
    backward, 1,708,288 with `stage3_max_reuse_distance: 0`. The walk below replays that rule over
    the step's module order (embedding, layers, lm_head; backward with each layer's recompute).
    QLoRA's 4-bit weights are gathered packed (quant_storage: numel/4 16-bit elements).

    `Settings.zero3_impl == "fsdp"` (PyTorch FSDP FULL_SHARD, one unit per decoder layer): the
    root unit (embeddings, final norm, lm_head) stays unsharded from forward to the end of the
    backward (torch/distributed/fsdp/_runtime_utils.py `_post_forward_reshard`: the root is not
    resharded after forward), and BackwardPrefetch.BACKWARD_PRE holds "the current set of
    parameters, next set of parameters" (PyTorch FSDP docs): the root plus two layers.

    `forward_only`: the DPO reference engine's (memfit.train.reference: ZeRO-3 with the policy's
    bucket sizes), which only runs forwards; nothing of it stays gathered after its forward.
    """
    d = dtype_bytes(cand.precision)
    layout = param_layout(arch)
    if settings.zero3_impl == "fsdp":
        per_layer = max(
            sum(n // 2 if cand.finetune == "qlora" and q else d * n for n, q in _zero3_layer_units(arch, i))
            for i in range(arch.num_layers)
        )
        return d * (layout.embed + layout.lm_head) + 2 * per_layer
    threshold = settings.stage3_param_persistence_threshold
    if threshold is None:
        threshold = 10 * arch.hidden_size if settings.scaled_buckets else 100_000
    qlora = cand.finetune == "qlora"
    layers = tuple(
        tuple(
            (n // 4, n // 2) if (qlora and quantizable) else (n, d * n)
            for n, quantizable in _zero3_layer_units(arch, layer)
            if (n // 4 if (qlora and quantizable) else n) >= threshold
        )
        for layer in range(arch.num_layers)
    )
    embed = (layout.embed, d * layout.embed)
    head = (layout.lm_head, d * layout.lm_head) if layout.lm_head else None
    limits = (settings.stage3_max_reuse_distance, settings.stage3_max_live_parameters)
    return _gathered_peak(
        layers, embed, head, cand.grad_ckpt, *limits, prefetch_bucket_elements(arch, settings), forward_only
    )


@functools.lru_cache(maxsize=512)
def _gathered_peak(
    layers: tuple[tuple[tuple[int, int], ...], ...],
    embed: tuple[int, int],
    head: tuple[int, int] | None,
    ckpt: bool,
    reuse: int,
    max_live: int,
    prefetch: int,
    forward_only: bool = False,
) -> int:
    """The replay of `zero3_gathered_bytes`: units are (ds_numel, bytes); returns peak bytes.
    `forward_only`: an engine that only runs forwards (the DPO reference), each a step of its own
    (parameter_offload.py `_start_of_forward_hook` resets the step, and the reuse walk looks no
    further than the step's trace)."""
    E = ("embed", *embed)
    H = ("lm_head", *head) if head else E  # tied: the embedding's parameter again
    fwd = [[((i, k), n, b) for k, (n, b) in enumerate(units)] for i, units in enumerate(layers)]
    seq = [E] + [u for units in fwd for u in units] + [H]
    if not forward_only:
        seq.append(H)  # lm_head forward, then its backward
        for units in reversed(fwd):
            seq += (units if ckpt else []) + units[::-1]  # recompute, then backward
        seq.append(E)
    live: dict = {}
    numel = bytes_ = peak = 0
    for i, (key, n, b) in enumerate(seq):
        if key not in live:
            live[key] = (n, b)
            numel, bytes_ = numel + n, bytes_ + b
        got, j = 0, i + 1
        while j < len(seq) and got < min(prefetch, max_live - numel):
            k2, n2, b2 = seq[j]
            if k2 not in live:
                live[k2] = (n2, b2)
                numel, bytes_, got = numel + n2, bytes_ + b2, got + n2
            j += 1
        peak = max(peak, bytes_)
        keep, traversed = False, 0
        for k2, n2, _ in seq[i + 1 :]:
            if traversed >= reuse:
                break
            if k2 == key:
                keep = True
                break
            traversed += n2
        if not keep:
            n0, b0 = live.pop(key)
            numel, bytes_ = numel - n0, bytes_ - b0
    return peak
