"""What the `search:` space cannot give, said with its real reason when the config is read
(`memfit.workflow.config.validate_config`), and the prepared data's row count against the global
batch (after prepare_data, before any probe).

- a key that does nothing (`search.lora_rank` with `finetune: [full]`): a warning (`search_warnings`);
- no combination of `search:` a method can train: every distinct reason once (offload_param
  without ZeRO-3, activation_offload without grad_ckpt, a sequence-parallel size that does not
  divide the ranks, a global batch no micro batch makes), with the keys involved;
- a GPU of `gpus:` on which every remaining candidate is one its hardware cannot run (flash on
  `cpu` or a V100, bf16 before Ampere), named with the key and the GPU, instead of a "no
  candidate fits" with memory advice after the estimate.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

from memfit.estimate.models import catalog
from memfit.estimate.models.validity import hardware_problems
from memfit.methods import kernels_problems, speed_problems
from memfit.methods import shape as method_shape
from memfit.space import Candidate, enumerate_space

# which search keys a hardware reason comes from (validity.hardware_problems' sentences)
_HARDWARE_KEYS = {
    "bf16": ("precision",),
    "FlashAttention-2": ("attn",),
    "offloading": ("offload_optimizer", "offload_param"),
}


def search_problems(cfg: Any) -> list[str]:
    """Every problem of `search:` for the configured methods and GPUs, one line each (`cfg`: a
    memfit.workflow.config.WorkflowConfig, which imports this module)."""
    out: list[str] = []
    untrainable: dict[str, list[str]] = {}  # the reasons -> the methods they stop
    for method in cfg.methods:
        cands, reasons = _trainable(cfg, method)
        if cands:
            out += _hardware(cfg, cands)
        else:
            untrainable.setdefault("; ".join(reasons), []).append(method)
    for reasons, methods in untrainable.items():
        where = f" for {' and '.join(methods)}" if len(untrainable) > 1 else ""
        out.insert(0, f"search: no combination can be trained{where}: {reasons}")
    return list(dict.fromkeys(out))  # a GPU's problem once, whichever method found it


def search_warnings(cfg: Any) -> list[str]:
    """Keys of `search:` that do nothing in this config: said, not refused (a template keeps
    `lora_rank` ready for the day `finetune` lists lora, as config/cluster-example.yaml does)."""
    search = cfg.raw["search"]
    finetunes = list(search.get("finetune", ["full"]))
    out = []
    if "lora_rank" in search and set(finetunes) == {"full"}:
        out.append(
            f"search.lora_rank: {list(search['lora_rank'])} does nothing with search.finetune {finetunes} "
            "(a full fine-tune has no adapter): no candidate uses it; add lora or qlora to search.finetune to search it"
        )
    if False in search.get("compile", [False]) and cfg.compile_problem():  # [false, true]: the eager ones stay
        out.append(f"search.compile: the compiled candidates are left out on gpus [cpu]: {cfg.compile_problem()}")
    if "none" in search.get("kernels", ["none"]) and cfg.kernels_problem():  # [none, liger]: the plain ones stay
        out.append(f"search.kernels: the liger candidates are left out: {cfg.kernels_problem()}")
    return out


def _axes(cfg: Any, method: str) -> dict[str, list[Any]]:
    axes = {k: list(v) for k, v in cfg.raw["search"].items() if k != "seq_len"}
    if not method_shape(method).reference:
        axes.pop("ref", None)
    return axes


def _keys(axes: dict[str, list[Any]], text: str) -> str:
    """The search keys a reason names (ZeRO-n is search.zero), with their values."""
    keys = [k for k in axes if k in text or (k == "zero" and "ZeRO" in text)]
    return ", ".join(f"search.{k} {axes[k]}" for k in keys)


def _trainable(cfg: Any, method: str) -> tuple[list[Candidate], list[str]]:
    """(the candidates `WorkflowConfig.candidates` keeps, each distinct reason a combination was dropped)."""
    axes = _axes(cfg, method)
    fixed = {"seq_len": cfg.seq_len}
    reasons: dict[str, None] = {}
    names = list(axes)
    for values in itertools.product(*(axes[n] for n in names)):
        try:
            Candidate(**fixed, **dict(zip(names, values, strict=True)))
        except (ValueError, TypeError) as e:
            for problem in str(e).removeprefix("invalid candidate: ").split("; "):
                keys = _keys(axes, problem)
                reasons[f"{keys}: {problem}" if keys else problem] = None
    try:
        return cfg.candidates(method), list(reasons)
    except ValueError as e:
        if str(e).startswith("search.micro_batch: kto"):
            return [], [*reasons, str(e)]
    world = cfg.world_size
    packing = bool((cfg.raw["train"].get(method) or {}).get("packing", False))
    batch = int(cfg.raw["train"]["global_batch"])
    for cand in enumerate_space(axes, fixed=fixed):
        speed = speed_problems(method, cand.padding_free, cand.sequence_parallel)
        if speed:
            for problem in speed:  # memfit.train.run_config's words, with the search keys they come from
                keys = "search.padding_free [True]" + (
                    f", search.sequence_parallel {axes['sequence_parallel']}" if "sequence_parallel" in problem else ""
                )
                fix = problem.replace("set it to false", "add false to search.padding_free")
                reasons[f"{keys}: {fix.replace('set padding_free: false', 'add false to search.padding_free')}"] = None
        elif cand.compile and cfg.compile_problem():
            reasons[f"search.compile [True] with gpus [cpu]: {cfg.compile_problem()}"] = None
        elif kernels := kernels_problems(method, cand.kernels):
            reasons[
                f"search.kernels {axes['kernels']}: {kernels[0].replace('set kernels: none', 'add none to search.kernels')}"
            ] = None
        elif cand.kernels == "liger" and cfg.kernels_problem():
            why = cfg.kernels_problem().replace("set kernels: none", "add none to search.kernels")
            reasons[f"search.kernels {axes['kernels']}: {why}"] = None
        elif world % cand.sequence_parallel:
            reasons[
                f"search.sequence_parallel: {cand.sequence_parallel} does not divide the {world} ranks "
                "(num_gpus x num_nodes)"
            ] = None
        elif packing and cand.sequence_parallel > 1 and cand.attn != "flash":
            reasons[
                f"train.{method}.packing: packed rows under sequence parallelism need attn flash "
                f"(search.attn {axes.get('attn')})"
            ] = None
        elif batch % (cand.micro_batch * cand.data_parallel(world)):
            reasons[
                f"train.global_batch: {batch} is not a multiple of micro_batch x data-parallel ranks for any "
                f"search.micro_batch in {axes.get('micro_batch', [1])} with {world} ranks"
            ] = None
    return [], list(reasons)


def _hardware(cfg: Any, cands: list[Candidate]) -> list[str]:
    out = []
    for i, name in enumerate(cfg.gpus):
        try:
            gpu = catalog.gpu(name)
        except ValueError:
            continue  # reported by the GPU checks
        problems = [hardware_problems(gpu, c) for c in cands]
        if all(problems):
            reasons = dict.fromkeys(p for ps in problems for p in ps)
            said = []
            for reason in reasons:
                keys = next((ks for word, ks in _HARDWARE_KEYS.items() if word in reason), ())
                listed = ", ".join(f"search.{k} {cfg.raw['search'].get(k, '[default]')}" for k in keys)
                said.append(f"{listed}: {reason}" if listed else reason)
            out.append(f"gpus[{i}]: every candidate of search: is one {name} cannot run: " + "; ".join(said))
    return out


def rows_problem(cfg: Any, method: str, stats_json: str | Path) -> str | None:
    """The prepared training rows against one global batch (`train.global_batch` rows, or packed
    sequences, per optimizer step: packing can only make fewer of them); None when they suffice."""
    stats = json.loads(Path(stats_json).read_text())
    rows = int(stats["rows_kept"]["train"])
    batch = int(cfg.raw["train"]["global_batch"])
    if rows >= batch:
        return None
    return (
        f"{stats_json}: {rows} training rows (data.{method}: {stats.get('source')}, after data.max_len's "
        f"filter and data.eval_fraction's split) are fewer than one global batch (train.global_batch: "
        f"{batch}); add rows to data.{method} or lower train.global_batch (a multiple of micro_batch x ranks)"
    )
