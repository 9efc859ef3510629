"""What each workflow stage does, given the validated workflow config.

Every Snakemake `script:` calls one function here with paths and the config (a
`memfit.workflow.config.WorkflowConfig`, or the validated dict Snakemake holds); this is where the
config meets the library (catalog, estimate, probe, select, train), so the stages can be run
and tested without Snakemake. The train stage lives in `memfit.workflow.training`. The resume check (`verify_resume`) lives in `memfit.workflow.resume_check`.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

from memfit.atomic import write_json_atomic
from memfit.estimate.models import catalog
from memfit.estimate.rows import Budget
from memfit.estimate.selection import NoneFits, choose, judge
from memfit.workflow.config import WorkflowConfig
from memfit.workflow.none_fits import export_files, write_none_fits
from memfit.workflow.training import set_aside_stale_checkpoints, train  # noqa: F401 - the train stage


# --------------------------------------------------------------------------- stages
def prepare_data(method: str, source: str, model_path: str, out_dir: Path, **kwargs: Any) -> dict[str, Any]:
    """Check that the model directory loads (config, weights, tokenizer: `memfit.workflow.model_check`),
    then tokenize `source` with its tokenizer (`memfit.data.prepare`, `kwargs` passed on)."""
    from memfit.data import prepare
    from memfit.workflow.model_check import check_model_dir

    check_model_dir(model_path)
    return prepare(method, source, model_path, out_dir, **kwargs)


def check_model(cfg: WorkflowConfig, model: str) -> None:
    """Before any probe: the model directory loads (`memfit.workflow.model_check`). A plan-only run
    never loads weights: it checks only the config.json of a directory that exists."""
    from memfit.workflow.model_check import check_model_dir

    path = cfg.model_path(model)
    if not cfg.plan_only:
        if not path:
            raise ValueError(f"models.{model}.path: not set; probes and training need the model directory")
        check_model_dir(path)
    elif path and (Path(path) / "config.json").exists():
        check_model_dir(path, weights=False, tokenizer=False)


def _estimate_settings(
    cfg: WorkflowConfig, calibration: Path | str | None = None, stats: Path | str | None = None
) -> Any:
    """The config's `estimate:` (the CPU-Adam rate and cores per rank among it), with this machine's
    step-time calibration (the calibrate stage) if any, and the prepared data's mean tokens per
    sequence and row length quantiles (prepare_data's `stats` file, `length.mean` and
    `length.quantiles`) that price padding_free and padded candidates on the data's rows
    (memfit.estimate.time.data_scale). Neither under SFT packing: packs fill to seq_len."""
    from memfit.estimate import Settings
    from memfit.estimate.time import runtime_costs

    est, train_cfg = cfg.estimate, cfg.raw.get("train") or {}  # and the tile sizes the trainer will use
    kw = {k: train_cfg.get(k) for k in ("loss_chunk_tokens", "mlp_tile_tokens")}
    kw["trace_cache"] = est.get("trace_cache")
    cal = str(calibration) if calibration else None
    kw |= runtime_costs.cpu_adam_settings(est)
    if stats and not _packing(cfg, stats):
        kw["row_tokens"], kw["row_length_quantiles"] = _row_tokens(stats), _row_length_quantiles(stats)
    return Settings(activations=est.get("activations", "analytic"), step_time_calibration=cal, **kw)


def _row_tokens(stats: Path | str | None) -> float | None:
    """stats.json's mean tokens per row (for pairs: the prompt and the longer response), or None."""
    if not stats:
        return None
    length = json.loads(Path(stats).read_text()).get("length") or {}
    mean = length.get("mean") if isinstance(length, dict) else None
    return float(mean) if isinstance(mean, int | float) and mean > 0 else None


def _packing(cfg: WorkflowConfig, stats: Path | str) -> bool:
    """The stats file's method trains packed rows (`train.<method>.packing`, SFT only)."""
    method = json.loads(Path(stats).read_text()).get("method")
    return bool(((cfg.raw.get("train") or {}).get(method) or {}).get("packing", False))


def _row_length_quantiles(stats: Path | str | None) -> tuple[float, ...] | None:
    """stats.json's `length.quantiles` (row lengths at p0..p100), or None for a file from before
    they were written; a ValueError naming the key and the file if they are not such a list."""
    if not stats:
        return None
    length = json.loads(Path(stats).read_text()).get("length") or {}
    q = length.get("quantiles") if isinstance(length, dict) else None
    if q is None:
        return None
    ok = isinstance(q, list) and len(q) >= 2 and all(isinstance(x, int | float) and x > 0 for x in q)
    if not ok or any(b < a for a, b in zip(q, q[1:], strict=False)):
        raise ValueError(
            f"{stats}: length.quantiles must be 2 or more positive row lengths in nondecreasing order "
            "(prepare_data writes p0..p100); prepare the data again"
        )
    return tuple(float(x) for x in q)


def _estimate_rows(
    cfg: WorkflowConfig,
    arch: Any,
    gpu: str,
    method: str,
    b: Budget,
    cands: list[Any],
    calibration: Path | str | None = None,
    stats: Path | str | None = None,
) -> list[dict[str, Any]]:
    """Every candidate of `cands` estimated on `cfg`'s topology and the budget `b`."""
    from memfit.estimate import estimate_space

    return estimate_space(
        arch,
        catalog.gpu(gpu),
        cfg.num_gpus,
        cfg.num_nodes,
        method,
        cands,
        host_memory_gb=b.host_bytes / 1e9,
        budget_bytes=b.device_limit_bytes,
        settings=_estimate_settings(cfg, calibration, stats),
    )


def estimate_candidates(
    config: WorkflowConfig | dict[str, Any],
    model: str,
    gpu: str,
    method: str,
    out_json: Path,
    calibration: Any = None,
    stats: Any = None,
) -> dict[str, Any]:
    """Predict every candidate; rank those predicted to fit by predicted speed; mark the probes.
    `calibration`: this machine's step-time calibration (the calibrate stage), else modelled times."""
    cfg = WorkflowConfig.of(config)
    check_model(cfg, model)
    arch = catalog.model(cfg.arch_source(model), allow_moe=True)
    b = cfg.budget(gpu)
    settings = _estimate_settings(cfg, calibration, stats)
    rows = _estimate_rows(cfg, arch, gpu, method, b, cfg.candidates(method), calibration, stats)
    ranked = sorted(
        (r for r in rows if r["fits"] and not r["invalid"]),
        key=lambda r: -r["tokens_per_s"],  # fastest predicted first
    )
    probe = [] if cfg.plan_only else probe_choice(ranked, cfg.probe.top_k)
    probe += [i for i in lever_twins(rows, probe) if i not in probe]
    compare = reference_twin(rows, probe) if method == "dpo" else None
    if compare and compare["model"] not in probe:
        probe.append(compare["model"])  # one probe more: the same candidate holding a reference model
    boundary = [] if cfg.plan_only else boundary_probe(rows, probe, b, cfg.probe.boundary_margin)
    probe += [i for i in boundary if i not in probe]
    result = {
        "model": model,
        "gpu": gpu,
        "method": method,
        "world_size": cfg.world_size,
        "budget": dataclasses.asdict(b),
        "arch": dataclasses.asdict(arch),
        "estimator": f"memfit.estimate (activations {settings.activations})",
        "step_time_calibration": str(calibration) if calibration else None,
        "probe": probe,
        "boundary_probe": boundary,
        "reference_compare": compare,
        "rows": rows,
    }
    write_json_atomic(out_json, result)
    return result


def probe_choice(ranked: list[dict[str, Any]], top_k: int) -> list[str]:
    """The fastest candidates predicted to fit, the last place going to the one predicted to need
    the least memory: if the prediction is optimistic for the fast ones, a measured fallback exists."""
    chosen = [r["id"] for r in ranked[:top_k]]
    if top_k > 1 and ranked:
        smallest = min(ranked, key=lambda r: r["device_total_bytes"])["id"]
        if smallest not in chosen:
            chosen[-1] = smallest
    return chosen


def boundary_probe(rows: list[dict[str, Any]], probe: list[str], budget: Budget, margin: float) -> list[str]:
    """The fastest candidate predicted *not* to fit, by at most `margin` over the device budget
    (device memory less headroom) and within the host's, if it is predicted faster than every probe.

    The estimator decides exactly there: if it is pessimistic, this candidate fits and wins
    (measured beats predicted); if it is right, the probe runs out of memory for real and the
    OOM (phase, live bytes) is recorded as data. A candidate that would not win even if it fit
    is not worth a probe, so there is one such probe at most. [] when there is none.
    """
    if margin <= 0:
        return []
    by_id, limit = {r["id"]: r for r in rows}, budget.device_limit_bytes
    fastest = max((by_id[i]["tokens_per_s"] or 0.0 for i in probe), default=0.0)
    near = [
        r
        for r in rows
        if not r["invalid"]
        and not r["fits"]
        and r["id"] not in probe
        and limit < r["device_total_bytes"] <= limit * (1 + margin)
        and r.get("host_bytes", 0) <= budget.host_bytes
        and (r["tokens_per_s"] or 0.0) > fastest
    ]
    return [max(near, key=lambda r: r["tokens_per_s"])["id"]] if near else []


# The speed levers (search keys) and their plain value: a candidate using one is probed beside its
# plain twin, so the selection compares the lever by two measurements (on the CPU demo, compiled
# probes ran within 12% of their eager twins either way: docs/speed.md).
SPEED_LEVERS = {"compile": False, "padding_free": False, "kernels": "none"}


def lever_twins(rows: list[dict[str, Any]], probe: list[str]) -> list[str]:
    """For each probed candidate that uses a speed lever, the candidate equal to it with every
    lever at its plain value, where that twin is valid and predicted to fit (its id, in probe order)."""
    by_id = {r["id"]: r for r in rows}
    twins: list[str] = []
    for cid in probe:
        cand = by_id[cid]["candidate"]
        plain = {**cand, **{k: v for k, v in SPEED_LEVERS.items() if k in cand}}
        if plain == cand:
            continue
        twin = next((r for r in rows if r["candidate"] == plain), None)
        if twin is not None and twin["fits"] and not twin["invalid"] and twin["id"] not in probe + twins:
            twins.append(twin["id"])
    return twins


def reference_twin(rows: list[dict[str, Any]], probe: list[str]) -> dict[str, str] | None:
    """The first probed DPO candidate without a reference model, and its twin that holds one.

    Probing both measures what `ref: precomputed` (or `adapter`) saves over `ref: model` on
    the same ZeRO stage, micro batch and checkpointing; the report shows the two side by
    side. The twin is probed even when predicted not to fit: the measurement is the point.
    None when the search space offers no such pair.
    """
    by_id = {r["id"]: r for r in rows}
    for cid in probe:
        cand = by_id[cid]["candidate"]
        if cand.get("ref") == "model":
            continue
        twin = next(
            (r for r in rows if not r["invalid"] and r["candidate"] == {**cand, "ref": "model"}),
            None,
        )
        if twin is not None:
            return {cand["ref"]: cid, "model": twin["id"]}
    return None


def probe_candidate(
    config: WorkflowConfig | dict[str, Any],
    method: str,
    cand_id: str,
    candidates_json: Path,
    model_path: str,
    data_dir: str,
    out_json: Path,
    log: Path,
) -> dict[str, Any]:
    """A few real training steps of one candidate of `candidates_json` (OOM is a result)."""
    from memfit.workflow.probe import ProbeFailed, run_probe

    cfg = WorkflowConfig.of(config)
    table = json.loads(Path(candidates_json).read_text())
    row = next((r for r in table["rows"] if r["id"] == cand_id), None)
    if row is None:
        raise ValueError(f"{candidates_json}: no candidate {cand_id!r}")
    run = cfg.run_config(method, row["candidate"], model_path, data_dir, str(Path(out_json).parent))
    # Without CUDA the rank's live tensor bytes are held to the budget's device memory
    # (`cpu_memory_mib` on `cpu`): the probe then OOMs as it would on a GPU of that size.
    run = dataclasses.replace(run, device_capacity_bytes=int(table["budget"]["device_bytes"]))
    result = run_probe(
        run,
        nproc=cfg.num_gpus,
        nnodes=cfg.num_nodes,
        out_json=Path(out_json),
        log=Path(log),
        steps=cfg.probe.steps,
        timeout_s=cfg.probe.timeout_s,
        prediction=row,
    )
    if result["status"] == "error":
        # Not a measurement (OOM and timeout are): a bug, a broken model or data directory. Every
        # other probe would fail alike and selection would end in "no candidate fits", so stop
        # here, leaving no probe JSON (a re-run probes again), with the cause on the console.
        Path(out_json).unlink(missing_ok=True)
        raise ProbeFailed(probe_failure_message(cand_id, result, log))
    return result


def probe_failure_message(cand_id: str, result: dict[str, Any], log: Path | str | None) -> str:
    from memfit.workflow.probe import error_excerpt

    excerpt = error_excerpt(Path(log) if log else None) or result.get("log_tail", "")
    indented = "\n".join("    " + line for line in excerpt.splitlines())
    return (
        f"probe of {cand_id} failed ({result.get('error', 'error')}), not for lack of memory or time; "
        + (f"the first error in {log}:" if log else "the end of its log:")
        + f"\n{indented}\n"
        "Fix the cause and re-run (other candidates would likely fail alike; a re-run probes this one again)."
    )


def select_config(
    config: WorkflowConfig | dict[str, Any],
    model: str,
    gpu: str,
    method: str,
    candidates_json: Path,
    probe_jsons: list[Path],
    model_path: str,
    data_dir: str,
    train_dir: str,
    out: dict[str, Path],
) -> dict[str, Any]:
    """Choose; write selected.json (with every loser's reason), ds_config.json, run.json, launch.sh,
    and the exports to OpenRLHF, LLaMA-Factory and HF (`memfit.exports.FILES`; `out` may name them,
    else they go under exports/ beside selected.json).

    ds_config.json is the DeepSpeed config training runs with: the step count comes from the
    prepared data as the trainer computes it (`dsconfig.planned_steps`); a plan without prepared
    data and without `max_steps` writes "auto" there (see `dsconfig.build`)."""
    from memfit import exports
    from memfit.train import dsconfig

    cfg = WorkflowConfig.of(config)
    table = json.loads(Path(candidates_json).read_text())
    probes = _read_probes(probe_jsons)
    b = Budget(**table["budget"])
    try:
        best, ranked = choose(judge(table["rows"], probes, b, table["world_size"], method, gpu=gpu), b)
    except NoneFits as e:
        more = _nodes_that_fit(cfg, model, gpu, method, b)
        e = NoneFits(e.rows, e.what, more) if more else e
        if not cfg.plan_only:
            raise e from None  # a training run stops here, with every candidate's reason
        return write_none_fits(model, gpu, method, table, cfg, e, out)
    run = cfg.run_config(method, best.candidate, model_path, data_dir, train_dir)
    run = dataclasses.replace(run, device_capacity_bytes=int(table["budget"]["device_bytes"]))
    run.save(out["run"])
    # (how the step count was found is not added to selected.json: tests/test_select.py pins its bytes)
    total_steps, schedule = dsconfig.planned_steps(run, table["world_size"])
    ds = dsconfig.for_run(run, table["world_size"], total_steps, table["arch"]["hidden_size"])
    write_json_atomic(out["ds_config"], ds)
    cmd = _write_launch(cfg, out)
    files = export_files(out, method)
    (Path(out["selected"]).parent / exports.NONE_FITS).unlink(missing_ok=True)  # an earlier plan's, where nothing fit
    exports.write_all(
        exports.ExportPlan(
            run=run,
            ds_config=ds,
            num_gpus=cfg.num_gpus,
            num_nodes=cfg.num_nodes,
            total_steps=total_steps,
            warmup_steps=schedule["warmup_steps"],
            data_source=cfg.data_source(method),  # data.<method>, else data.dpo for the pair methods and kto
            eval_fraction=float(cfg.raw["data"].get("eval_fraction", 0.0)),
            assistant_loss=cfg.raw["data"].get("assistant_loss", "all"),
            files=files,
        )
    )
    selected = {
        "model": model,
        "gpu": gpu,
        "method": method,
        "selected": best.to_json(),
        "budget": table["budget"],
        "plan_only": cfg.plan_only,
        "launch": cmd,
        "candidates": [r.to_json() for r in ranked],
    }
    write_json_atomic(out["selected"], selected)
    return selected


def _read_probes(probe_jsons: list[Path]) -> dict[str, dict[str, Any]]:
    """Probe results by candidate id; a probe that failed for another reason than OOM stops here."""
    probes = {}
    for p in probe_jsons:
        d = json.loads(Path(p).read_text())
        if d.get("status") == "error":  # written by a memfit before probes that fail stopped the workflow
            from memfit.workflow.probe import ProbeFailed

            raise ProbeFailed(f"{p}: " + probe_failure_message(d["id"], d, d.get("log")))
        probes[d["id"]] = d
    return probes


def _write_launch(cfg: WorkflowConfig, out: dict[str, Path]) -> str:
    """launch.sh: the command the `train` rule runs; returns that command."""
    cmd = f"memfit launch --config {shlex.quote(str(out['run']))} --nproc {cfg.num_gpus}"
    if cfg.num_nodes > 1:  # one launcher per node: srun starts them, torchrun meets at the first host
        cmd = f"srun --nodes {cfg.num_nodes} --ntasks-per-node 1 {cmd} --nnodes {cfg.num_nodes}"
    Path(out["launch"]).write_text(
        "#!/usr/bin/env bash\n# Trains with the selected configuration (what the `train` rule runs).\n"
        f"# DeepSpeed config: {out['ds_config']} (what the trainer builds from run.json).\nset -euo pipefail\n{cmd}\n"
    )
    return cmd


MAX_NODES_HINT = 16  # how far `_nodes_that_fit` looks: a few cheap re-estimates, not a search of the cluster


def _nodes_that_fit(cfg: WorkflowConfig, model: str, gpu: str, method: str, b: Budget) -> str:
    """When nothing fits on `num_nodes`: the smallest node count (same GPU type, same GPUs per
    node, same global batch, so grad_accum shrinks) at which a candidate of the search space is
    predicted to fit, re-estimated as estimate_candidates estimates (same architecture source and
    settings); "" on the CPU, where more nodes is not the answer."""
    if gpu == "cpu":
        return ""
    arch = catalog.model(cfg.arch_source(model), allow_moe=True)
    for nodes in range(cfg.num_nodes + 1, MAX_NODES_HINT + 1):
        wider = WorkflowConfig.of(cfg.raw | {"num_nodes": nodes})
        try:
            cands = wider.candidates(method)
        except ValueError:  # the global batch cannot be split over this many ranks
            continue
        rows = _estimate_rows(wider, arch, gpu, method, b, cands)
        fitting = [r for r in judge(rows, {}, b, wider.world_size, method) if r.fits and r.tokens_per_s]
        if fitting:
            best = max(fitting, key=lambda r: r.tokens_per_s or 0.0)
            return f"would fit on {nodes} nodes (estimate; {cfg.num_gpus} {gpu} per node, fastest there: {best.id})"
    return f"would not fit on up to {MAX_NODES_HINT} nodes of {cfg.num_gpus} {gpu} either (estimate)"


def log_to(path: str | Path) -> None:
    """Send this process's stderr (warnings, progress bars, tracebacks) to the rule's log."""
    import sys

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    sys.stderr = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the script
    console = sys.__stderr__

    def on_error(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        # The traceback goes to the log; the error itself also to the console Snakemake prints
        # on, so a failed job says why there (not only "check log file(s) for error details").
        import traceback

        traceback.print_exception(kind, exc, tb, file=sys.stderr)
        if console is not None:
            console.write(f"memfit: {kind.__name__}: {exc}\n(traceback in {path})\n")
            console.flush()

    sys.excepthook = on_error
