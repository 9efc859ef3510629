"""What each workflow stage does, given the validated workflow config.

Every Snakemake `script:` calls one function here with paths and the config; this is
where config keys meet the library (catalog, estimate, probe, select, train, report),
so the stages can be run and tested without Snakemake.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
from pathlib import Path
from typing import Any

from memfit import catalog, checkpoint
from memfit.atomic import write_json_atomic
from memfit.select import Budget, choose, judge
from memfit.space import Candidate, enumerate_space
from memfit.train import RunConfig, option_problems

GiB = 2**30


# --------------------------------------------------------------------------- config helpers
def world_size(config: dict[str, Any]) -> int:
    return int(config["num_gpus"]) * int(config.get("num_nodes", 1))


def model_source(config: dict[str, Any], model: str) -> str:
    """Where the architecture comes from: the model directory if it has weights, else the catalog."""
    path = config["models"][model].get("path")
    if path and (Path(path) / "config.json").exists():
        return path
    return config["models"][model].get("arch") or model


def budget(config: dict[str, Any], gpu_name: str) -> Budget:
    gpu = catalog.gpu(gpu_name)
    if gpu.name == "cpu":
        device = int(float(config["cpu_memory_mib"]) * 2**20)
    else:
        device = gpu.memory_bytes
    host_gib = config.get("host_memory_gib") or gpu.typical_host_memory_gb * 1e9 / GiB
    return Budget(device_bytes=device, host_bytes=int(float(host_gib) * GiB), headroom=float(config["headroom"]))


def seq_len(config: dict[str, Any]) -> int:
    return int(config["search"].get("seq_len") or config["data"]["max_len"])


def candidates(config: dict[str, Any], method: str) -> list[Candidate]:
    """The configured search space, with grad_accum set so every candidate trains the same global batch."""
    axes = {k: v for k, v in config["search"].items() if k != "seq_len"}
    if method != "dpo":
        axes.pop("ref", None)
    world = world_size(config)
    global_batch = int(config["train"]["global_batch"])
    out = []
    for cand in enumerate_space(axes, fixed={"seq_len": seq_len(config)}):
        per_step = cand.micro_batch * world
        if global_batch % per_step:
            continue  # this micro batch cannot make the global batch on this many ranks
        out.append(dataclasses.replace(cand, grad_accum=global_batch // per_step))
    if not out:
        raise ValueError(
            f"train.global_batch={global_batch} is not a multiple of micro_batch x ranks for any "
            f"micro_batch in {config['search'].get('micro_batch')} with {world} ranks"
        )
    return out


# --------------------------------------------------------------------------- stages
def estimate_candidates(config: dict[str, Any], model: str, gpu: str, method: str, out_json: Path) -> dict[str, Any]:
    """Predict every candidate; rank those predicted to fit by predicted speed; mark the probes."""
    from memfit.estimate import Settings, estimate_space

    arch = catalog.model(model_source(config, model))
    b = budget(config, gpu)
    est = config.get("estimate") or {}
    settings = Settings(activations=est.get("activations", "analytic"), trace_cache=est.get("trace_cache"))
    rows = estimate_space(
        arch,
        catalog.gpu(gpu),
        int(config["num_gpus"]),
        int(config.get("num_nodes", 1)),
        method,
        candidates(config, method),
        host_memory_gb=b.host_bytes / 1e9,
        budget_bytes=b.device_limit_bytes,
        settings=settings,
    )
    ranked = sorted(
        (r for r in rows if r["fits"] and not r["invalid"]),
        key=lambda r: -r["tokens_per_s"],  # fastest predicted first
    )
    probe = [] if config.get("plan_only") else probe_choice(ranked, int(config["probe"]["top_k"]))
    compare = reference_twin(rows, probe) if method == "dpo" else None
    if compare and compare["model"] not in probe:
        probe.append(compare["model"])  # one probe more: the same candidate holding a reference model
    result = {
        "model": model,
        "gpu": gpu,
        "method": method,
        "world_size": world_size(config),
        "budget": dataclasses.asdict(b),
        "arch": dataclasses.asdict(arch),
        "estimator": f"memfit.estimate (activations {settings.activations})",
        "probe": probe,
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


def run_config(config: dict[str, Any], model: str, gpu: str, method: str, cand: dict[str, Any], model_path: str, data_dir: str, out_dir: str) -> RunConfig:
    """The training run config for one candidate: the config's `train` section plus the method's."""
    train = config["train"]
    per_method = dict(train[method])
    dpo = {k: per_method.pop(k) for k in ("beta", "loss_type", "label_smoothing") if k in per_method}
    if "export" in per_method:  # train.<method>.export: merged | adapter
        per_method["export_format"] = per_method.pop("export")
    common = {k: train[k] for k in ("seed", "save_every", "keep_last", "eval_every", "log_every") if k in train}
    return RunConfig(
        method=method,
        model_path=model_path,
        data_dir=data_dir,
        out_dir=out_dir,
        candidate=cand,
        dpo=dpo,
        ref_model_path=model_path if method == "dpo" else None,
        **common,
        **per_method,
    )


def probe_candidate(config, model, gpu, method, cand_id, candidates_json, model_path, data_dir, out_json, log) -> dict[str, Any]:
    from memfit.probe import run_probe

    table = json.loads(Path(candidates_json).read_text())
    row = next(r for r in table["rows"] if r["id"] == cand_id)
    run = run_config(config, model, gpu, method, row["candidate"], model_path, data_dir, str(Path(out_json).parent))
    return run_probe(
        run,
        nproc=int(config["num_gpus"]),
        out_json=Path(out_json),
        log=Path(log),
        steps=int(config["probe"]["steps"]),
        timeout_s=float(config["probe"].get("timeout_s", 900)),
        prediction=row,
    )


def select_config(config, model, gpu, method, candidates_json, probe_jsons, model_path, data_dir, train_dir, out: dict[str, Path]) -> dict[str, Any]:
    """Choose; write selected.json (with every loser's reason), ds_config.json, run.json, launch.sh."""
    from memfit import dsconfig

    table = json.loads(Path(candidates_json).read_text())
    probes = {}
    for p in probe_jsons:
        d = json.loads(Path(p).read_text())
        probes[d["id"]] = d
    b = Budget(**table["budget"])
    best, ranked = choose(judge(table["rows"], probes, b, table["world_size"], method))
    run = run_config(config, model, gpu, method, best.candidate, model_path, data_dir, train_dir)
    run.save(out["run"])
    ds = dsconfig.build(
        run.cand,
        table["world_size"],
        lr=run.lr,
        total_steps=run.max_steps or 0,
        warmup_steps=run.warmup_steps,
        weight_decay=run.weight_decay,
        grad_clip=run.grad_clip,
        min_lr_ratio=run.min_lr_ratio,
        hidden_size=table["arch"]["hidden_size"],
    )
    write_json_atomic(out["ds_config"], ds)
    cmd = f"memfit launch --config {shlex.quote(str(out['run']))} --nproc {int(config['num_gpus'])}"
    Path(out["launch"]).write_text(
        "#!/usr/bin/env bash\n# Trains with the selected configuration (what the `train` rule runs).\n"
        f"# DeepSpeed config: {out['ds_config']} (the trainer rebuilds it with the step count).\nset -euo pipefail\n{cmd}\n"
    )
    selected = {
        "model": model,
        "gpu": gpu,
        "method": method,
        "selected": best.to_json(),
        "budget": table["budget"],
        "plan_only": bool(config.get("plan_only")),
        "launch": cmd,
        "candidates": [r.to_json() for r in ranked],
    }
    write_json_atomic(out["selected"], selected)
    return selected


def train(run_json: Path, nproc: int, log: Path) -> dict[str, Any]:
    from memfit.launch import launch

    run = RunConfig.load(run_json)
    set_aside_stale_checkpoints(run, Path(log))
    rc = launch(Path(run_json), nproc, log=Path(log))
    if rc != 0:
        raise RuntimeError(f"training failed (exit code {rc}); see {log}. Re-running resumes from the newest checkpoint.")
    return json.loads((Path(run.out_dir) / "summary.json").read_text())


def set_aside_stale_checkpoints(run: RunConfig, log: Path) -> None:
    """Snakemake re-runs `train` when the selected configuration changed: checkpoints of the
    previous configuration cannot continue this run, so they move to `checkpoints.previous`
    (replacing an older one) instead of blocking the run; a crash of the same run resumes."""
    ckpts = Path(run.out_dir) / "checkpoints"
    found = checkpoint.latest_valid(ckpts, log=lambda _msg: None)
    if found is None:
        return
    meta = json.loads((found[0] / found[1] / "memfit.json").read_text())
    try:
        checkpoint.check_compatible(meta, dataclasses.asdict(run), found[0] / found[1], world=int(meta["world_size"]))
        return
    except ValueError as e:
        reason = str(e).splitlines()[1:-1]
    dest = ckpts.with_name("checkpoints.previous")
    shutil.rmtree(dest, ignore_errors=True)
    ckpts.rename(dest)
    (Path(run.out_dir) / "metrics.jsonl").unlink(missing_ok=True)
    with open(log, "a") as f:
        f.write(f"configuration changed; moved old checkpoints to {dest}:\n" + "\n".join(reason) + "\n")


def verify_resume(run_json: Path, nproc: int, out_json: Path, log: Path, rtol: float = 1e-5) -> dict[str, Any]:
    """Resume the finished run from its previous checkpoint and compare with what it did uninterrupted."""
    from memfit.launch import launch

    run = RunConfig.load(run_json)
    ckpts = Path(run.out_dir) / "checkpoints"
    tags = checkpoint.complete_tags(ckpts)
    if len(tags) < 2:
        raise RuntimeError(f"{ckpts} holds {len(tags)} checkpoint(s); verify_resume needs the final one and an earlier one (keep_last >= 2, save_every < steps)")
    tag = tags[-2]
    work = Path(out_json).parent / "verify_resume.run"
    shutil.rmtree(work, ignore_errors=True)
    resumed = dataclasses.replace(run, out_dir=str(work), resume=str(ckpts / tag), keep_last=1)
    resumed.save(work / "run.json")
    rc = launch(work / "run.json", nproc, log=Path(log))
    if rc != 0:
        raise RuntimeError(f"resumed run failed (exit code {rc}); see {log}")
    result = compare_runs(Path(run.out_dir), work, int(tag.removeprefix("step")), rtol)
    trained = json.loads((Path(run.out_dir) / "summary.json").read_text())
    resumed_summary = json.loads((work / "summary.json").read_text())
    result |= {
        "resumed_from": str(ckpts / tag),
        "rtol": rtol,
        # resume is where runs die a second time: its peak beside the uninterrupted training peak
        "training_peak_allocated_bytes": trained["peak_allocated_bytes"],
        "resume_peak_allocated_bytes": resumed_summary.get("resume_peak_allocated_bytes"),
        "resume_host_rss_bytes": resumed_summary.get("resume_host_rss_bytes"),
        "training_host_rss_bytes": trained.get("host_rss_bytes_max_rank"),
        "memory_source": trained.get("memory_source"),
    }
    write_json_atomic(out_json, result)
    shutil.rmtree(work / "checkpoints", ignore_errors=True)
    return result


def compare_runs(original: Path, resumed: Path, from_step: int, rtol: float) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    def rows(d: Path) -> dict[tuple[int, str], dict[str, Any]]:
        out = {}
        for line in (d / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            out[(r["step"], r["split"])] = r
        return out

    a, b = rows(original), rows(resumed)
    keys = sorted(k for k in a if k[0] > from_step)
    missing = [k for k in keys if k not in b]
    diffs = [abs(a[k]["loss"] - b[k]["loss"]) / max(abs(a[k]["loss"]), 1e-12) for k in keys if k in b]
    # the exported weights: the model, or the adapter only (train.<method>.export: adapter)
    name = "adapter_model.safetensors" if (original / "model" / "adapter_model.safetensors").exists() else "model.safetensors"
    wa = load_file(str(original / "model" / name))
    wb = load_file(str(resumed / "model" / name))
    wdiff = max(float((wa[n].float() - wb[n].float()).abs().max()) for n in wa)
    bitwise = all(torch.equal(wa[n], wb[n]) for n in wa)
    max_rel = max(diffs, default=0.0)
    return {
        "from_step": from_step,
        "final_step": max(k[0] for k in a),
        "steps_compared": len(keys),
        "missing_steps": [list(k) for k in missing],
        "max_rel_loss_diff": max_rel,
        "losses_bitwise_equal": all(a[k]["loss"] == b[k]["loss"] for k in keys if k in b),
        "weights_max_abs_diff": wdiff,
        "weights_bitwise_equal": bitwise,
        "passed": not missing and max_rel <= rtol,
    }


# --------------------------------------------------------------------------- config validation
SCHEMA = Path(__file__).resolve().parents[2] / "workflow" / "schemas" / "config.schema.yaml"


class ConfigError(ValueError):
    """A workflow config that cannot run; the message names every offending key."""


def validate_config(config: dict[str, Any], schema_path: Path = SCHEMA) -> None:
    """Schema check plus what a schema cannot know (catalog names, files, method sections).

    Raises ConfigError listing each problem as `key.path: what is wrong (allowed: ...)`,
    before any job starts.
    """
    import jsonschema
    import yaml

    schema = yaml.safe_load(Path(schema_path).read_text())
    _coerce_numbers(config, schema, schema)
    problems = []
    for err in sorted(jsonschema.Draft7Validator(schema).iter_errors(config), key=lambda e: list(e.path)):
        where = ".".join(str(p) for p in err.path) or "(top level)"
        msg = err.message
        if err.validator == "enum":
            msg = f"{err.instance!r} is not allowed (allowed: {', '.join(map(repr, err.validator_value))})"
        elif err.validator == "additionalProperties":
            allowed = sorted(err.schema.get("properties", {}))
            msg = f"{msg} (allowed keys: {', '.join(allowed)})" if allowed else msg
        problems.append(f"{where}: {msg}")
    if not problems:
        problems += _semantic_problems(config)
    if problems:
        raise ConfigError("invalid memfit config:\n  " + "\n  ".join(problems))


def _coerce_numbers(value: Any, node: dict[str, Any], root: dict[str, Any]) -> Any:
    """Numbers written as strings where the schema wants a number: YAML 1.1 reads `1e-5` (no dot)
    as a string, and `snakemake --config 'train={...}'` passes nested values as strings."""
    if "$ref" in node:
        node = root["definitions"][node["$ref"].rsplit("/", 1)[-1]]
    types = node.get("type", [])
    types = [types] if isinstance(types, str) else types
    if isinstance(value, str) and {"number", "integer"} & set(types):
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if "integer" in types and number.is_integer() else number
    if isinstance(value, dict):
        for k, v in value.items():
            child = node.get("properties", {}).get(k) or (node.get("additionalProperties") if isinstance(node.get("additionalProperties"), dict) else None)
            if child:
                value[k] = _coerce_numbers(v, child, root)
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        value[:] = [_coerce_numbers(v, node["items"], root) for v in value]
    return value


def _semantic_problems(config: dict[str, Any]) -> list[str]:
    out = []
    gpus = catalog.load_gpus()
    for i, name in enumerate(config["gpus"]):
        try:
            catalog.gpu(name)
        except ValueError as e:
            out.append(f"gpus[{i}]: {e} (allowed: {', '.join(sorted(gpus))})")
    plan_only = bool(config.get("plan_only"))
    for name, m in config["models"].items():
        path = m.get("path")
        has_weights = bool(path) and (Path(path).exists() or "build" in m)
        if "build" in m and not Path(m["build"]).exists():
            out.append(f"models.{name}.build: file {m['build']} does not exist")
        if not has_weights:
            if not plan_only:
                out.append(f"models.{name}.path: {path!r} is not a model directory; training needs weights (or set plan_only: true)")
            try:
                catalog.model(m.get("arch") or name)
            except ValueError as e:
                out.append(f"models.{name}: no weights and no architecture: {e}")
    for method in config["methods"]:
        if method not in config["train"]:
            out.append(f"train.{method}: missing (methods lists {method})")
        src = config["data"].get(method)
        if not plan_only:
            if not src:
                out.append(f"data.{method}: missing (methods lists {method})")
            elif not Path(src).exists():
                out.append(f"data.{method}: {src} does not exist")
    for method in ("sft", "dpo"):
        t = config["train"].get(method)
        if t is not None:
            out += option_problems(method, t.get("loss_on", "response"), bool(t.get("packing", False)),
                                   t.get("export", "merged"), list(config["search"].get("finetune", ["full"])))
    if not out:
        try:
            for method in config["methods"]:
                candidates(config, method)
        except ValueError as e:
            out.append(f"train.global_batch: {e}")
    return out


def log_to(path: str | Path) -> None:
    """Send this process's stderr (warnings, progress bars, tracebacks) to the rule's log."""
    import sys

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    sys.stderr = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the script
