"""The traced runs' processes (memfit.estimate.trace.trace keys and caches them): a batch of shapes in
worker processes forked from a server that imported torch, transformers and peft once
(memfit.estimate.trace.trace_worker), and the progress lines a batch reports (`progress_to`).
Inside `shared_workers` every batch (of any kind of layer, from any thread) runs on one set of
workers, started once and kept: memfit.estimate.fit traces a model's kinds of layer at once and
again a round later, and a worker keeps what its first trace imported and cached (the model's
transformers module, the fake tensors' dispatch cache).

    from memfit.estimate.trace import trace
    with trace.progress_to(lambda line: print(line, file=sys.stderr)):
        trace.layer_trace(arch, 4096, "sdpa", "bf16", True, "lora")
    # tracing qwen3.5-27b at 4,096 tokens (sdpa, bf16, lora r16, checkpointing): 1 shape, 1 process
    # traced qwen3.5-27b at 4,096 tokens (sdpa, bf16, lora r16, checkpointing) in 41.2 s (...)
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from typing import Any

from memfit.estimate.errors import TraceError
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.trace.trace_step import TRACE_LAYERS, trace_keys  # noqa: F401 - TRACE_LAYERS is API here

ENV_IN_PROCESS = "MEMFIT_TRACE_IN_PROCESS"

# Where progress lines go while something traces (`progress_to`): a stack of callables, the
# top one in use; process-wide, so the threads memfit.estimate.fit starts report too.
_PROGRESS: list[Callable[[str], None] | None] = []
_SAY_LOCK = threading.Lock()


@contextmanager
def progress_to(say: Callable[[str], None] | None) -> Iterator[None]:
    """While inside, every trace that runs (a cache hit is silent) reports to `say`, one line
    (a str, no newline) when a batch starts and one per traced shape with its seconds, as
    `memfit fit` reports its steps; None: silent. Restored on exit; nests."""
    _PROGRESS.append(say)
    try:
        yield
    finally:
        _PROGRESS.pop()


def reporter(progress: Callable[[str], None] | None) -> Callable[[str], None]:
    say = progress if progress is not None else (_PROGRESS[-1] if _PROGRESS else None)

    def report(line: str) -> None:
        if say is not None:
            with _SAY_LOCK:  # the threads of several batches report at once
                say(line)

    return report


def _label(arch: ModelArch) -> str:
    """The model, and the kind of layer when it is one of several (generic.layer_groups): its
    config.layer_types entry, else the layer it stands for."""
    if not arch.layer_kind:
        return arch.name
    first = arch.layer_kind[0]
    try:
        types = json.loads(arch.hf_config or "{}").get("layer_types") or []
        return f"{arch.name} ({types[first]} layers)"
    except (ValueError, TypeError, AttributeError, IndexError):
        return f"{arch.name} (layers like layer {first})"


def _shape_text(key: dict[str, Any]) -> str:
    ft = key["finetune"] + (f" r{key['lora_rank']}" if key["finetune"] != "full" else "")
    ckpt = ", checkpointing" if key["grad_ckpt"] else ""
    return f"{key['seq_len']:,} tokens ({key['attn']}, {key['precision']}, {ft}{ckpt})"


def trace_workers() -> int:
    """Child processes for a batch of traces: $MEMFIT_TRACE_WORKERS, else the CPUs this process
    may use (each child is single-threaded: fake tensors do no arithmetic)."""
    env = os.environ.get("MEMFIT_TRACE_WORKERS")
    if env:
        return max(1, int(env))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


Runs = dict[str, dict[str, int]]  # TRACE_LAYERS ("1", "2") -> MEASURES per sequence


def _trace_in_children(
    batches: list[tuple[ModelArch, list[dict[str, Any]]]],
    report: Callable[[str], None] = lambda line: None,
    workers: int | None = None,
) -> list[list[tuple[Runs, float]]]:
    """Trace each batch's `keys` (of its architecture: a mixed model's kinds of layer are one
    batch each) in up to `workers` (default trace_workers()) child processes, all batches on one
    pool (inside `shared_workers`: its pool, `workers` unused), in the order given: a caller
    puts its longest first. Results in order, batch by batch; a progress line to `report` as a
    batch starts and as each shape is done. In this process with $MEMFIT_TRACE_IN_PROCESS=1
    (benchmarks/bench_coverage.py: a tiny model's trace takes less than a child's start-up)."""
    t0 = time.perf_counter()
    in_process = os.environ.get(ENV_IN_PROCESS) == "1"
    shared = bool(_SHARED) and not in_process
    total = sum(len(keys) for _, keys in batches)
    size = _SHARED[-1][1] if shared else (workers or trace_workers())
    n = 1 if in_process else min(size, total)
    for arch, keys in batches:
        shapes = ", ".join(_shape_text(k) for k in keys)
        m = min(n, len(keys))
        on = f"{m} of the {size} shared process{'es' * (size > 1)}" if shared else f"{m} process{'es' * (m > 1)}"
        report(f"tracing {_label(arch)} at {shapes}: {len(keys)} shape{'s' * (len(keys) > 1)}, {on}")

    def done(arch: ModelArch, key: dict[str, Any], seconds: float) -> None:
        report(f"traced {_label(arch)} at {_shape_text(key)} in {seconds:.1f} s "
               f"({time.perf_counter() - t0:.1f} s since the batch started)")  # fmt: skip

    if in_process:
        out = []
        for arch, keys in batches:
            try:
                res = trace_keys(arch, keys, lambda i, r, a=arch, k=keys: done(a, k[i], float(r["seconds"])))
            except Exception as exc:  # noqa: BLE001 - as a child's failure reads
                raise TraceError(f"tracing {arch.name!r} failed: {type(exc).__name__}: {exc}") from None
            out.append([(r["runs"], float(r["seconds"])) for r in res])
        return out
    out: list[list[tuple[Runs, float] | None]] = [[None] * len(keys) for _, keys in batches]
    errors: list[tuple[str, str]] = []  # (architecture, error)
    # workers forked from a server that imported torch, transformers and peft once
    # (memfit.estimate.trace.trace_worker); each takes the next shape when it is free, a shape
    # whole (its 1- and 2-layer runs as two tasks gave no gain: qwen3.5-122b-a10b's cold fit took
    # 63.3 s split against 54.4 s whole, back to back at load 5, 2026-11-28). (A pool that notices
    # a worker killed mid-shape: multiprocessing.Pool would wait forever.)
    with contextlib.ExitStack() as stack:
        pool = _SHARED[-1][0] if shared else stack.enter_context(_pool(n))
        try:
            with _main_not_imported():  # a submit starts a worker while none is free
                futures = {
                    pool.submit(_worker_run, (i, arch, key)): b
                    for b, (arch, keys) in enumerate(batches)
                    for i, key in enumerate(keys)
                }
            for future in as_completed(futures):
                b = futures[future]
                arch, keys = batches[b]
                i, runs, seconds, error = future.result()
                if error:
                    errors.append((arch.name, error))
                    continue
                out[b][i] = (runs, seconds)
                done(arch, keys[i], seconds)
        except BrokenProcessPool:
            errors.append((batches[0][0].name, "a trace worker process died (killed by the system: out of memory?)"))
    if errors:
        raise TraceError(f"tracing {errors[0][0]!r} failed: {errors[0][1]}")
    missing = [arch.name for b, (arch, _) in enumerate(batches) if any(r is None for r in out[b])]
    if missing:
        raise TraceError(f"tracing {missing[0]!r} failed: a worker gave no result")
    return [[r for r in results if r is not None] for results in out]


_CONTEXT: list = []
_SHARED: list[tuple[ProcessPoolExecutor, int]] = []  # the open shared_workers pool and its size


@contextmanager
def shared_workers(workers: int | None = None, start: bool = False) -> Iterator[None]:
    """While inside, every batch of traces (any architecture, any thread) runs on one pool of
    `workers` (default trace_workers()) processes, each started when a task waits and no
    worker is free and kept until the block ends, instead of a pool per batch. `start`: start
    the fork server now, in the background (its imports: 4.4 CPU s, `/usr/bin/time python -c
    'import memfit.estimate.trace.trace_worker'` on the 2-core dev machine, 2026-11-28), so that it
    loads while this process works towards its first trace; else at the first trace, if any.
    Nested: the outer pool serves. Not with $MEMFIT_TRACE_IN_PROCESS=1 (traced in this process)."""
    if _SHARED or os.environ.get(ENV_IN_PROCESS) == "1":
        yield
        return
    from multiprocessing import forkserver

    _workers()  # the context, with its preload, before the server starts
    if start:
        with _main_not_imported():  # the server is told the parent's main module: hidden, as for a worker
            forkserver.ensure_running()
    n = workers or trace_workers()
    with _pool(n) as pool:
        _SHARED.append((pool, n))
        try:
            yield
        finally:
            _SHARED.remove((pool, n))


@contextmanager
def _pool(n: int) -> Iterator[ProcessPoolExecutor]:
    """A pool of up to `n` trace workers, each of which exits when this process dies, by any
    signal (trace_worker.exit_with_parent). Closed when the block ends: once its shapes are
    done; when an exception leaves the block (Ctrl-C, the SIGTERM that memfit's CLI raises:
    cli_setup.sigterm_unwinds) its workers are terminated first, so that no shape nobody will
    read holds up the exit (qwen3.5-27b's linear-attention layers at 1,024 tokens: 21.2 s in a
    cold `memfit fit --maximize seq_len --model qwen3.5-27b --gpu a100-80gb --num-gpus 8 --zero 3
    --activations traced` on the 2-core dev machine, 2026-11-28)."""
    pool = ProcessPoolExecutor(n, mp_context=_workers(), initializer=_worker_start)
    try:
        yield pool
    except BaseException:
        _terminate(pool)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _terminate(pool: ProcessPoolExecutor) -> None:
    """SIGTERM to every worker of `pool` (ProcessPoolExecutor.terminate_workers from Python 3.14;
    before, its `_processes`, pid -> Process, as CPython 3.9-3.13's concurrent/futures/process.py
    keeps them); the pool, broken, fails what is left."""
    stop = getattr(pool, "terminate_workers", None)
    if stop is not None:
        stop()
        return
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        with contextlib.suppress(OSError, ValueError):  # exited meanwhile, or already closed
            proc.terminate()


def _workers():
    """The multiprocessing context of the trace workers: a fork server that preloads
    memfit.estimate.trace.trace_worker. A child keeps the estimating process clean: fake parameters
    outlive a traced backward (held from C++ by autograd/FakeTensorMode state), and a later real
    measurement in that process (memory.AllocationTracker's baseline scans live tensors) would
    count them."""
    if not _CONTEXT:
        import multiprocessing

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["memfit.estimate.trace.trace_worker"])
        _CONTEXT.append(ctx)
    return _CONTEXT[0]


_LAUNCH = threading.Lock()


@contextmanager
def _main_not_imported() -> Iterator[None]:
    """While workers start: a process that is not forked imports the parent's __main__ first
    (multiprocessing.spawn.get_preparation_data: its module name or file), which would run a
    script's top-level code again in every worker (a Snakemake script: the whole rule). The
    workers need nothing of it: its name and file are hidden meanwhile."""
    main = sys.modules.get("__main__")
    with _LAUNCH:
        saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__dict__["__spec__"] = None
        try:
            yield
        finally:
            if main is not None:
                main.__dict__.update(saved)
                if "__spec__" not in saved:
                    main.__dict__.pop("__spec__", None)


def _worker_start() -> None:
    from memfit.estimate.trace.trace_worker import exit_with_parent

    exit_with_parent()


def _worker_run(task):
    from memfit.estimate.trace.trace_worker import run

    return run(task)
