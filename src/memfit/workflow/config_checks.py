"""What a schema cannot check in a workflow config: catalog names, model directories, files, the
context length, method sections, the ranks per node, the search space (memfit.workflow.search_checks).

`semantic_problems(cfg)` takes a `memfit.workflow.config.WorkflowConfig` (duck-typed: this module
must not import config, which calls it) and returns each problem as `key: what is wrong`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memfit.estimate.models import catalog
from memfit.methods import METHODS, REFERENCE_METHODS
from memfit.methods import shape as method_shape

AUTO = "auto"  # headroom auto or absent: the derived margin (memfit.estimate.rows.derived_budget)


def _model_dir_problems(name: str, path: Path) -> list[str]:
    """An existing local model directory the workflow will train: config.json it can read,
    an architecture it can estimate, a tokenizer and weights (what `transformers` loads)."""
    key = f"models.{name}.path"
    if not path.is_dir():
        return [f"{key}: {path} is not a directory (a HF model directory: config.json, weights, tokenizer)"]
    if not any(path.iterdir()):
        # an empty directory is a placeholder (a mount not populated yet; the dry-run tests'
        # stand-ins): the architecture comes from the catalog and the loader reports it at train
        return []
    out = []
    if not (path / "config.json").is_file():
        out.append(f"{key}: {path / 'config.json'} is missing")
    else:
        try:
            catalog.model(str(path), allow_moe=True)  # experts are modelled (estimate.memory.states)
        except (ValueError, OSError, KeyError) as e:
            out.append(f"{key}: {str(e).strip(chr(39))}")
    tokenizer = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if not any((path / f).is_file() for f in tokenizer):
        out.append(f"{key}: no tokenizer in {path} (expected one of {', '.join(tokenizer)})")
    weights = [*path.glob("*.safetensors"), *path.glob("pytorch_model*.bin"), *path.glob("adapter_model.*")]
    if not weights:
        out.append(f"{key}: no weights in {path} (expected *.safetensors or pytorch_model*.bin)")
    return out


def _context_problems(cfg: Any) -> list[str]:
    """data.max_len (or search.seq_len) beyond a model's context (max_position_embeddings)."""
    out = []
    seq = cfg.seq_len
    key = "search.seq_len" if cfg.raw["search"].get("seq_len") else "data.max_len"
    for name in cfg.models:
        source = cfg.arch_source(name)
        build = cfg.model(name).build
        if build and source != cfg.model(name).path:
            source = build  # not built yet: the architecture is the config it is built from
        try:
            arch = catalog.model(source, allow_moe=True)
        except (ValueError, OSError, KeyError):
            continue  # reported by the model checks
        context = arch.max_position_embeddings
        if context and seq > context:
            out.append(f"{key}: {seq} is beyond models.{name}'s context of {context} tokens (max_position_embeddings)")
    return out


def _gpu_problems(cfg: Any) -> list[str]:
    """Unknown GPU names (in `gpus` and `slurm.gpu_types`) and planning-only GPUs in a training run."""
    out = []
    gpus = catalog.load_gpus()
    for i, name in enumerate(cfg.gpus):
        try:
            gpu = catalog.gpu(name)
        except ValueError as e:
            out.append(f"gpus[{i}]: {e} (allowed: {', '.join(sorted(gpus))})")
            continue
        if gpu.planning_only and not cfg.plan_only:
            out.append(
                f"gpus[{i}]: {name} is for planning only ({gpu.planning_reason.strip()}); "
                "set plan_only: true to estimate and select for it without training"
            )
    for name in cfg.slurm.get("gpu_types") or {}:
        # a site-wide section may list GPU types this config does not use, but not a typo
        if name not in cfg.gpus and name not in gpus:
            out.append(f"slurm.gpu_types.{name}: not a GPU name (allowed: {', '.join(sorted(gpus))})")
    return out


def _ranks_per_node_problems(cfg: Any) -> list[str]:
    """`num_gpus` counts GPUs per node (DESIGN.md: `--num-gpus`, `--num-nodes`): more than one node
    holds is refused, naming the split into nodes, as `memfit estimate --num-gpus` refuses it."""
    from memfit.estimate.cli_checks import MAX_GPUS_PER_NODE  # 16: DGX-2/HGX-2, cited there

    n = cfg.num_gpus
    if n <= MAX_GPUS_PER_NODE or all(g == "cpu" for g in cfg.gpus):
        return []
    per_node = next((k for k in (8, 4, 2) if n % k == 0), None)
    split = (
        f"for {n} GPUs write num_gpus: {per_node} and num_nodes: {n // per_node * cfg.num_nodes}"
        if per_node
        else "give the GPUs of one node in num_gpus and the nodes in num_nodes"
    )
    return [
        f"num_gpus: {n} is more than one node holds (at most {MAX_GPUS_PER_NODE}, NVIDIA DGX-2/HGX-2); "
        f"num_gpus counts GPUs per node: {split}"
    ]


DPO_KEYS = ("beta", "loss_type", "label_smoothing")  # memfit.train.losses.DPOConfig's fields
KTO_MIN_MICRO_BATCH = method_shape("kto").min_micro_batch  # TRL's KTOTrainer refuses 1 (memfit.methods)


def _hyperparameters(method: str) -> tuple[str, ...]:
    from memfit.train import preference

    return DPO_KEYS if method == "dpo" else preference.hyperparameters(method)


def hyperparameter_problems(method: str, section: dict[str, Any]) -> list[str]:
    """A `train.<method>` key that is another method's hyperparameter (DPO's loss_type under orpo,
    simpo_gamma under dpo), named with the keys the method takes; then the method's values checked
    by its own config (memfit.train.preference: TRL's names and ranges)."""
    from memfit.train import preference
    from memfit.train.run_config import preference_problems

    every = set(DPO_KEYS).union(*(preference.hyperparameters(m) for m in preference.METHODS))
    own = _hyperparameters(method)
    stray = sorted(k for k in section if k in every and k not in own)
    if stray:
        takes = f"{method} takes {', '.join(own)}" if own else f"{method} takes none of them"
        owners = [m for m in ("dpo", *preference.METHODS) if stray[0] in _hyperparameters(m)]
        return [f"train.{method}.{stray[0]}: a hyperparameter of {', '.join(owners)}, not of {method} ({takes})"]
    if method not in preference.METHODS:
        return []
    # the search space's micro batches are checked by WorkflowConfig.candidates (KTO drops those below 2)
    return preference_problems(method, {k: section[k] for k in own if k in section}, KTO_MIN_MICRO_BATCH)


def semantic_problems(cfg: Any) -> list[str]:
    from memfit.train.run_config import option_problems

    raw, out = cfg.raw, _gpu_problems(cfg) + _ranks_per_node_problems(cfg)
    if raw.get("headroom", AUTO) == AUTO and "cpu" in raw["gpus"]:  # the margin is a GPU's measured error
        out.append("headroom: 'auto' (or omitted) has no measured margin for the cpu device: give one, e.g. 0.10")
    for name in cfg.models:
        m = cfg.model(name)
        if m.build is not None and not Path(m.build).exists():
            out.append(f"models.{name}.build: file {m.build} does not exist")
        if m.build is None and m.path and Path(m.path).exists() and not cfg.plan_only:
            out += _model_dir_problems(name, Path(m.path))
        if not cfg.will_have_weights(name):
            if not cfg.plan_only:
                out.append(
                    f"models.{name}.path: {m.path!r} is not a model directory; training needs weights (or set plan_only: true)"
                )
            try:
                catalog.model(m.arch or name, allow_moe=True)
            except ValueError as e:
                out.append(f"models.{name}: no weights and no architecture: {e}")
    if not out:
        out += _context_problems(cfg)
    if not cfg.plan_only:
        # the workflow always runs verify_resume after training (memfit.workflow.resume_check), which
        # resumes from an earlier checkpoint than the final one
        if raw["train"].get("save_every", 1) == 0:
            out.append(
                "train.save_every: 0 writes no checkpoints, but verify_resume needs two "
                "(use a step count below the run's steps, or plan_only: true)"
            )
    search = raw["search"]
    if (
        any(m in REFERENCE_METHODS for m in cfg.methods)
        and "adapter" in search.get("ref", [])
        and set(search.get("finetune", ["full"])) == {"full"}
    ):
        out.append(
            "search.ref: 'adapter' (the reference = the base model under the LoRA adapter) needs "
            "finetune lora or qlora, but search.finetune is [full]; drop 'adapter' or add lora"
        )
    for method in cfg.methods:
        if method not in raw["train"]:
            out.append(f"train.{method}: missing (methods lists {method})")
        src, key = cfg.data_source(method), cfg.data_key(method)
        if not cfg.plan_only:
            if not src:
                also = "" if key == f"data.{method}" else f" (or data.{method})"
                out.append(f"{key}: missing (methods lists {method}{also})")
            elif not Path(src).exists():
                out.append(f"{key}: {src} does not exist")
    for method, t in raw["train"].items():
        if method in METHODS and isinstance(t, dict):
            out += option_problems(
                method,
                t.get("loss_on", "response"),
                bool(t.get("packing", False)),
                t.get("export", "merged"),
                list(raw["search"].get("finetune", ["full"])),
            )
            out += hyperparameter_problems(method, t)
    if not out:
        from memfit.workflow.search_checks import search_problems

        # no trainable combination (each real reason once), a GPU that can run none of them,
        # a search key that does nothing
        out += search_problems(cfg)
    return out
