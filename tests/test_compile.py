"""The compile lever (run config `compile: true`, docs/speed.md): regional torch.compile of the decoder
layers (memfit.train.compile) trains the same as eager under DeepSpeed ZeRO-0 and ZeRO-3 on 2 ranks,
on the CPU through inductor's C++ backend.

Tolerance: inductor fuses the layer's elementwise ops (RMSNorm, SiLU x up, RoPE, residual adds) and
may reorder the reductions inside them, so each forward differs from eager by float32 rounding
(~1e-6 relative per op). Over 3 optimizer steps at lr 3e-3 those differences grow through the
weights; the losses of the demo model (about 5.7) agree within 1e-3 absolute, far below the 0.05 the
loss moves per step, so a compiled layer computing anything else (a wrong mask, a lost gradient: the
later steps' losses would not fall alike) fails."""

from __future__ import annotations

import dataclasses

import pytest
from deepspeed_runs import run

from memfit.train.compile import compile_problem, cpp_compiler

pytestmark = pytest.mark.skipif(compile_problem() is not None, reason=str(compile_problem()))


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 3])
def test_compiled_steps_train_like_eager(shared_runs, tmp_path, zero):
    """The eager run: the session's shared `base_run` of this ZeRO stage (tests/deepspeed_runs.py
    `SharedRuns`); the compiled run: the same config with `compile: true`, its first 3 steps compared."""
    _, a = shared_runs[f"sft-z{zero}"]
    compiled = dataclasses.replace(shared_runs.config(f"sft-z{zero}"), out_dir=str(tmp_path / "compiled"), compile=True)
    b = run(compiled)
    la = [r["loss"] for r in a if r["split"] == "train"][:3]
    lb = [r["loss"] for r in b if r["split"] == "train"][:3]
    assert len(la) == len(lb) == 3
    assert la == pytest.approx(lb, abs=1e-3)
    assert la[-1] < la[0]  # it trains
    # the layers compiled at the first step (under the CPU's AllocationTracker too: it used to
    # make dynamo skip them) and the steps after it compiled at most once more, for a batch of a
    # new length (then with dynamic shapes; measured: ZeRO-0 2,2,2,2,3,3 graphs, the evaluation's
    # no-grad graph counted from step 1): a recompile per step (a changing attribute, the
    # accumulation boundary) would make every step pay inductor's compile
    graphs = [r["compiled_graphs"] for r in b if r["split"] == "train"]
    assert graphs[0] >= 1 and graphs == sorted(graphs) and graphs[-1] <= graphs[1] + 1, graphs
    log = (tmp_path / "compiled" / "log.txt").read_text()
    assert (
        f"compile: 4 decoder layers (LlamaDecoderLayer) compiled one by one, inductor (CPU, C++: {cpp_compiler()})"
        in log
    )


def _lora_step(demo_model, rows, compiled: bool, padding_free: bool = False):
    """One SFT forward and backward of the demo model as the trainer builds it for a LoRA candidate
    with gradient checkpointing and the chunked loss (no DeepSpeed): loss, adapter gradients."""
    import torch

    from memfit.space import Candidate
    from memfit.train.compile import compile_layers
    from memfit.train.modeling import load_model
    from memfit.train.steps import StepRunner

    torch.manual_seed(0)  # the same LoRA initialisation both times
    cand = Candidate.from_dict(
        {"finetune": "lora", "lora_rank": 8, "grad_ckpt": True, "loss_impl": "chunked", "precision": "fp32"}
        | {"padding_free": padding_free}
    )
    model = load_model(str(demo_model), cand, trainable=True)
    if compiled:
        compile_layers(model)
    model.train()
    runner = StepRunner("sft", model, None, 0, loss_impl="chunked", loss_chunk_tokens=64, padding_free=padding_free)
    loss, _, _ = runner.loss(rows)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("padding_free", [False, True])
def test_compiled_lora_checkpointed_chunked_step_equals_eager(demo_model, demo_data, padding_free):
    """LoRA adapters, gradient checkpointing (the compiled layer is recomputed in the backward) and
    the chunked loss (hooks on the eager head) under compile: the loss within 1e-5 and the adapters'
    gradients within 1e-4 relative of eager (fp32 rounding of inductor's fused elementwise ops, see
    the module docstring), and one compiled graph serves all 4 layers; padding_free too (memfit's
    per-sequence sdpa compiled inside the layer, its sequences' lengths an input of the graph)."""
    import torch
    from torch._dynamo.utils import counters

    from memfit.data import load_split

    rows = load_split(demo_data / "sft", "train")[:8]
    eager_loss, eager_grads = _lora_step(demo_model, rows, False, padding_free)
    counters.clear()
    loss, grads = _lora_step(demo_model, rows, True, padding_free)
    assert counters["stats"]["unique_graphs"] == 1  # regional: the layers share one compiled code object
    assert loss == pytest.approx(eager_loss, abs=1e-5)
    assert grads.keys() == eager_grads.keys() and any("lora_A" in n for n in grads)
    for name, g in eager_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_compile_without_a_cpp_compiler_is_refused(monkeypatch):
    """No C++ compiler on the PATH (and no $CXX): the run is refused with the reason before any model
    loads, instead of failing inside inductor at the first step."""
    import memfit.train.compile as mc

    monkeypatch.setattr(mc.shutil, "which", lambda name: None)
    monkeypatch.setattr(mc.torch.cuda, "is_available", lambda: False)
    why = mc.compile_problem()
    assert why is not None and why.startswith("compile: true needs a C++ compiler")


def test_an_empty_kernel_a_killed_compile_left_is_removed(tmp_path, monkeypatch):
    """A rank killed while inductor wrote a kernel library leaves an empty .so in the shared cache, and
    every later compile of that code failed ("main.so: file too short"): compile_layers removes empty
    ones first (a finished library is never empty) and keeps the others."""
    from memfit.train.compile import drop_truncated_kernels

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    (tmp_path / "6n").mkdir()
    empty, built = tmp_path / "6n" / "c6n.main.so", tmp_path / "6n" / "c7x.main.so"
    empty.write_bytes(b"")
    built.write_bytes(b"\x7fELF" + b"\0" * 60)
    assert drop_truncated_kernels() == 1
    assert not empty.exists() and built.exists()


@pytest.mark.parametrize("grad_ckpt", [False, True])
def test_compiled_layers_compile_and_their_saved_tensors_count_under_the_allocation_tracker(demo_model, grad_ckpt):
    """Every CPU probe, calibration and training step runs under memfit's AllocationTracker, a
    TorchDispatchMode; with one on the stack dynamo used to skip every frame, so `compile: true`
    ran eagerly on the CPU and measured no faster (issue #45). Under the tracker the layers now
    compile once (one graph for the 4 layers, none more in the later steps) and the tensors the
    compiled layers keep for the backward, which inductor's own kernels fill out of the tracker's
    sight, are counted in its live bytes at the end of the forward. With gradient checkpointing the
    compiled code calls a higher-order operator (run_and_save_rng_state), which the tracker used
    to refuse with NotImplementedError."""
    import torch
    from transformers import AutoModelForCausalLM

    from memfit.train.compile import compile_layers, compiled_graphs
    from memfit.train.memory import AllocationTracker

    model = AutoModelForCausalLM.from_pretrained(str(demo_model), dtype=torch.float32)
    model.train()
    if grad_ckpt:  # as memfit.train.modeling sets it up, before the compile
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compile_layers(model)
    ids = torch.randint(3, model.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(0))
    weights = {p.untyped_storage()._cdata for p in model.parameters()}  # saved too, but live before the step
    before = compiled_graphs()
    graphs = []
    with AllocationTracker("cpu") as tracker:
        for _ in range(3):
            baseline = tracker.current_bytes
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # as StepRunner calls it
            forward_bytes = tracker.current_bytes - baseline
            saved, todo, seen = {}, [loss.grad_fn], set()
            while todo:  # the compiled layers' backward nodes hold what their forward saved
                node = todo.pop()
                if node is None or node in seen:
                    continue
                seen.add(node)
                if "CompiledFunction" in type(node).__name__:
                    for t in node.saved_tensors:
                        if t.untyped_storage()._cdata not in weights:
                            saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
                todo.extend(n for n, _ in node.next_functions)
            loss.backward()
            model.zero_grad(set_to_none=True)
            graphs.append(compiled_graphs() - before)
            del loss
            assert saved and forward_bytes >= sum(saved.values())
    assert graphs == [1, 1, 1]


def test_a_step_that_compiled_is_left_out_of_the_steady_step_time():
    # the demo's compiled SFT probe (3 steps, 2 ranks, ZeRO-0, 2026-11-28): step 1 compiled, step 2
    # recompiled (torch.compile's dynamic shapes), step 3 ran the compiled layers; counted with step 2
    # its figure was 0.296 s (spread 64%), above the eager twin's 0.199 s, and the selection called
    # them tied and took the compiled one by the tie rule
    from memfit.train.run_parts import StepTime, steady_step_times

    probe = [StepTime(8.18, 1), StepTime(0.434, 2), StepTime(0.157, 2)]
    assert steady_step_times(probe) == [0.157]
    eager = [StepTime(0.24), StepTime(0.208), StepTime(0.191)]
    assert steady_step_times(eager) == [0.208, 0.191]  # no compile: the steps after the warm-up
    every = [StepTime(8.0, 1), StepTime(0.5, 2), StepTime(0.4, 3)]
    assert steady_step_times(every) == [0.5, 0.4]  # every step compiled: still a figure
    assert steady_step_times([1.0, 0.2, 0.3, 0.25]) == [0.3, 0.25]  # plain floats: 4+ steps drop two
