"""Checkpoints that hold only what trains (QLoRA): the adapter weights in the module state, beside
DeepSpeed's optimizer shards; the 4-bit base is rebuilt from the model directory on resume.

DeepSpeed's `save_checkpoint(exclude_frozen_parameters=True)` (runtime/engine.py
`module_state_dict`) drops the frozen *parameters* but keeps every other state-dict entry, and a
bitsandbytes `Linear4bit` writes its quantization state (absmax, quant_map, the nested constants:
bitsandbytes nn/modules.py `_save_to_state_dict`) as extra entries: part of the base, not of the
run. `adapter_only_state_dict` trims the module state to the trainable parameters while a
checkpoint is written; `load_adapter_state` is the matching `custom_load_fn` of
`load_checkpoint`, which checks that the checkpoint holds exactly the trainable parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


def _trainable(module) -> set[str]:
    return {n for n, p in module.named_parameters() if p.requires_grad}


@contextlib.contextmanager
def adapter_only_state_dict(module) -> Iterator[None]:
    """While active, `module.state_dict()` holds its trainable parameters only."""
    keep = _trainable(module)

    def trim(_module, state, prefix, _meta) -> None:
        for key in [k for k in state if k.removeprefix(prefix) not in keep]:
            del state[key]

    handle = module.register_state_dict_post_hook(trim)
    try:
        yield
    finally:
        handle.remove()


def load_adapter_state(src: dict, dst) -> None:
    """Load an adapter-only module state into `dst`: every trainable parameter must be in `src`
    and nothing else may be (a checkpoint of another adapter or of a full model is refused)."""
    keep = _trainable(dst)
    missing, unexpected = sorted(keep - set(src)), sorted(set(src) - keep)
    if missing or unexpected:
        raise ValueError(
            f"adapter-only checkpoint does not match the model's trainable parameters: "
            f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )
    dst.load_state_dict(src, strict=False)
