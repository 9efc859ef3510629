"""The `compile` lever: regional `torch.compile` of the decoder layers (RunConfig.compile).

Each decoder layer is compiled with `nn.Module.compile()` (torch/nn/modules/module.py: it sets the
module's `_compiled_call_impl`, so `layer(...)` runs the compiled call and the module, its state
dict and DeepSpeed's hooks stay what they were). The layers of a model are instances of one class
with the same code, and torch >= 2.5 inlines built-in nn.Module calls, so their parameters are
graph inputs rather than constants (torch._dynamo.config.inline_inbuilt_nn_modules): one compiled
code object serves every layer and the compile cost is that of one layer, not of the model. This is
torch's "regional compilation" recipe (pytorch.org/tutorials/recipes/regional_compilation.html) and
what torchtitan does per transformer block (torchtitan/models/llama3/infra/parallelize.py
`apply_compile`).

What stays eager: the embedding, the final norm, the head and the loss (memfit's chunked loss hooks
the head), and the attention mask built from the position ids (transformers' masking_utils runs
data-dependent code for packed rows, which would break a whole-model graph).

Applied to the model after LoRA adapters and gradient checkpointing are set up and before
`deepspeed.initialize`: checkpointing (transformers' GradientCheckpointingLayer.__call__) wraps the
compiled call, peft's LoRA linears are traced inside the layer, and DeepSpeed's ZeRO-3 parameter
hooks (declared `torch.compiler.disable` in deepspeed/runtime/zero/parameter_offload.py) run
between graph pieces. On the CPU the backend is inductor's C++ code generation, which needs a C++
compiler (`cpp_compiler`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def cpp_compiler() -> str | None:
    """The C++ compiler inductor's CPU backend would call (torch._inductor.cpp_builder picks $CXX,
    else c++/g++/clang++ on the PATH), or None when there is none."""
    import os

    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def compile_problem() -> str | None:
    """Why regional compile cannot run on this machine, or None. The CPU backend needs a C++
    compiler; CUDA uses Triton, which ships with torch's CUDA wheels."""
    if torch.cuda.is_available():
        return None
    if cpp_compiler() is None:
        return (
            "compile: true needs a C++ compiler for torch inductor's CPU backend (none of $CXX, c++, g++, "
            "clang++ is on the PATH); install one (apt-get install g++) or set compile: false"
        )
    return None


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: the modules whose class transformers names in `_no_split_modules`
    (the repeated block, e.g. LlamaDecoderLayer), found through peft and reward-model wrappers."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def drop_truncated_kernels() -> int:
    """Delete the empty kernel libraries (`*.so` of 0 bytes) in inductor's cache, and return how many.

    Inductor's CPU backend writes a kernel's `.so` in its cache (torch._inductor.runtime.runtime_utils
    `cache_dir()`, /tmp/torchinductor_<user> by default) and loads it from there on every later run
    with the same code. A process killed while the compiler wrote it (an OOM-killed rank, a preempted
    run) leaves an empty file, and each later compile of that code then fails with "ImportError: ...
    main.so: file too short" (seen on this project's CPU). An empty file is never a finished
    library, so removing it only makes inductor build it again."""
    from torch._inductor.runtime.runtime_utils import cache_dir

    dropped = 0
    for so in Path(cache_dir()).glob("*/*.so"):
        try:
            if so.stat().st_size == 0:
                so.unlink()
                dropped += 1
        except OSError:  # another rank removed it first
            pass
    return dropped


def compiled_graphs() -> int:
    """How many graphs dynamo has compiled in this process (torch._dynamo.utils.counters["stats"]
    ["unique_graphs"], counted in torch/_dynamo/output_graph.py at each graph it compiles). A run's
    count stops growing after its first step when nothing recompiles; 0 after a compiled layer ran
    means dynamo ran it eagerly (a TorchDispatchMode without `ignore_compile_internals` on the
    stack, as memfit's AllocationTracker was: torch/_dynamo/convert_frame.py skips every frame)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


_COMPILED: list[int] = []  # one entry per model compile_layers compiled in this process


def layers_compiled() -> bool:
    """Whether compile_layers compiled a model in this process (memory.AllocationTracker then counts
    the tensors compiled layers save, which inductor's kernels fill out of a dispatch mode's sight)."""
    return bool(_COMPILED)


def compile_layers(model: torch.nn.Module) -> str:
    """Compile every decoder layer of `model` in place (`nn.Module.compile`); one log line saying
    how many and what class. Raises RuntimeError when the model has no layer to compile."""
    layers = decoder_layers(model)
    if not layers:
        raise RuntimeError(
            f"compile: found no decoder layer in {type(model).__name__} (no class named in its _no_split_modules)"
        )
    dropped = drop_truncated_kernels()
    for layer in layers:
        layer.compile()
    _COMPILED.append(len(layers))
    kinds = sorted({type(m).__name__ for m in layers})
    backend = "inductor (CUDA, Triton)" if torch.cuda.is_available() else f"inductor (CPU, C++: {cpp_compiler()})"
    said = f"compile: {len(layers)} decoder layers ({', '.join(kinds)}) compiled one by one, {backend}"
    return said + (
        f"; removed {dropped} empty kernel files a killed compile left in inductor's cache" if dropped else ""
    )
