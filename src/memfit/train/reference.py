"""The DPO (and KTO) reference model: its engine and log-probs, precomputing them once (`ref: precomputed`),
and its memory: a workaround that lets a dropped ZeRO-3 reference engine be freed, and how to
check that it was."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import time
import weakref
from typing import Any

import torch

from memfit.space import Candidate
from memfit.train import dist as dist_env
from memfit.train import dsconfig, long_context
from memfit.train.batches import collate, rank_batches
from memfit.train.modeling import hidden_size, load_model, model_dir
from memfit.units import MIB


def _storage_refs(module) -> list[tuple[weakref.ref, int]]:
    """Weak references to the storages of `module`'s parameters (ZeRO-3 partitions included,
    which DeepSpeed keeps in `param.ds_tensor`), with their sizes: what is still allocated once
    the module should be gone."""
    out = {}
    for p in module.parameters():
        for t in (p, getattr(p, "ds_tensor", None)):
            if isinstance(t, torch.Tensor) and (st := t.untyped_storage()).nbytes():
                out[st._cdata] = (weakref.ref(st), st.nbytes())
    return list(out.values())


def _forget_zero3_module(module) -> None:
    """Let a ZeRO-3 engine's model be freed once the engine is dropped.

    Two module-level references in DeepSpeed 0.19.8 keep a dropped ZeRO-3 engine's model alive,
    so `del engine` left the precomputed reference's parameter partitions (1/world of the model
    per rank: 5.97 MB in the demo) allocated for the whole training run (found by walking
    gc.get_referrers from the reference model to a module global):
    - deepspeed/runtime/zero/parameter_offload.py: DeepSpeedZeRoOffload.__init__ pushes the top
      module onto the global FWD_MODULE_STACK, and nothing pops it;
    - deepspeed/runtime/zero/partitioned_param_coordinator.py: `__params_to_release` is a
      method under a class-level functools.lru_cache, whose keys hold the coordinator (and
      through it the module) for as long as the process lives. Clearing it only drops
      cached sets of parameter ids; the live policy engine recomputes them on the next step.
    """
    from deepspeed.runtime.zero import parameter_offload, partitioned_param_coordinator

    stack = parameter_offload.FWD_MODULE_STACK
    stack[:] = [m for m in stack if m is not module]
    coordinator = partitioned_param_coordinator.PartitionedParameterCoordinator
    fn = coordinator.__dict__.get("_PartitionedParameterCoordinator__params_to_release")
    # the lru_cache wrapper sits inside DeepSpeed's instrument_w_nvtx closure (deepspeed/utils/nvtx.py)
    for f in (fn, *(c.cell_contents for c in getattr(fn, "__closure__", None) or ())):
        if hasattr(f, "cache_clear"):
            f.cache_clear()


def reference_engine(
    cand: Candidate, ref_path: str, ds_cfg: dict[str, Any], quant_type: str = "nf4", mlp_tile_tokens: int | None = None
):
    """The frozen DPO reference as a DeepSpeed inference engine (its MLPs tiled as the policy's)."""
    import deepspeed

    ref_cfg = {
        "train_micro_batch_size_per_gpu": cand.micro_batch,
        "gradient_accumulation_steps": cand.grad_accum,
        "bf16": ds_cfg["bf16"],
        "fp16": ds_cfg["fp16"],
        # The frozen reference is sharded like the policy under ZeRO-3 (OpenRLHF's
        # get_eval_ds_config); ZeRO 0-2 keep a full replica per rank.
        "zero_optimization": {"stage": 3 if cand.zero == 3 else 0},
    }
    if cand.zero == 3 and (h := hidden_size(model_dir(ref_path))):
        # the same persistence threshold and prefetch bucket as the policy's
        ref_cfg["zero_optimization"].update(dsconfig.bucket_sizes(h, 3))
        ref_cfg["zero_optimization"].pop("reduce_bucket_size", None)
    if cand.zero == 3 and cand.offload_param != "none":
        ref_cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": cand.pin_memory}
    ref_hf = None
    if cand.zero == 3:
        from transformers.integrations import HfDeepSpeedConfig

        ref_hf = HfDeepSpeedConfig(ref_cfg)  # from_pretrained partitions the reference as it loads
    ref_model = load_model(ref_path, dataclasses.replace(cand, grad_ckpt=False), trainable=False, quant_type=quant_type)
    long_context.prepare(ref_model, cand, mlp_tile_tokens)
    engine = deepspeed.initialize(model=ref_model, config=ref_cfg)[0]
    engine.eval()
    del ref_hf
    return engine


def reference_logps(
    engine,
    rows: list[dict[str, Any]],
    pad_id: int,
    micro: int,
    world: int,
    rank: int,
    loss_impl: str = "full",
    loss_chunk_tokens: int | None = None,
    method: str = "dpo",
) -> torch.Tensor:
    """[len(rows), 2] summed log-probs: DPO (chosen, rejected); KTO (the row's completion, its KL
    completion: `kl_completion_ids`, fixed at prep time). Ranks split the rows, then all-reduce.
    `loss_impl` as the policy's (StepRunner): chunked never holds the reference's full logits."""
    from memfit.train.preference import kto
    from memfit.train.steps import StepRunner

    runner = StepRunner("dpo", engine, None, pad_id, loss_impl=loss_impl, loss_chunk_tokens=loss_chunk_tokens)
    out = torch.zeros(len(rows), 2, dtype=torch.float64)
    device = dist_env.device()
    with torch.no_grad():
        for idx, batch_rows in rank_batches(rows, micro, world, rank):
            n = len(batch_rows)
            if method == "kto":
                batch = {k: v.to(device) for k, v in kto.collate(batch_rows, pad_id).items()}
                parts = [kto._sequence_logps(runner, engine, batch, prefix) for prefix in ("", "kl_")]
            else:
                batch = {k: v.to(device) for k, v in collate("dpo", batch_rows, pad_id).items()}
                token_lp, _ = runner.token_logps(
                    engine, batch["labels"], input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
                )
                lp = token_lp.sum(-1)
                parts = [lp[:n], lp[n:]]
            if idx:
                out[idx, 0] = parts[0].double().cpu()
                out[idx, 1] = parts[1].double().cpu()
    totals = dist_env.all_reduce_sum(out.flatten().tolist())  # each row was filled by exactly one rank
    return torch.tensor(totals, dtype=torch.float64).view(len(rows), 2)


CACHE = "ref_logps.safetensors"  # in out_dir: {split: [rows, 2] float64}, its key in the metadata
LEGACY_CACHE = "ref_logps.pt"  # a pickle (memfit < issue 41): never loaded, removed


def cache_key(cfg, sizes: dict[str, int]) -> dict[str, str] | None:
    """What the cached log-probs were computed from: the reference model's and the prepared data's
    SHA-256 (RunConfig.inputs, memfit.train.identity) and the rows per split. None without digests
    (a run not started by memfit's launcher): nothing is reused then."""
    ref, data = cfg.inputs.get("ref"), cfg.inputs.get("data")
    if not ref or not data:
        return None
    return {"ref_sha256": ref, "data_sha256": data, "sizes": json.dumps(sizes, sort_keys=True)}


def load_cached(path, key: dict[str, str] | None) -> dict[str, torch.Tensor] | None:
    """The cached log-probs when `path` was written for `key`, else None. safetensors holds
    tensors and string metadata only: reading it runs no code from the run folder."""
    from safetensors import SafetensorError, safe_open

    if key is None or not path.exists():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            if f.metadata() != key:
                return None
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    except (SafetensorError, OSError, ValueError):  # torn or foreign: computed again
        return None


def save_cached(path, key: dict[str, str], values: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in values.items()}, str(tmp), metadata=key)
    os.replace(tmp, path)


def precompute_reference(run, ds_cfg: dict[str, Any]) -> None:
    """ref=precomputed (`run` is the memfit.train.loop.Run at hand): one inference pass of the reference over every row (only the worst-case
    rows for a probe) before the policy exists, so training holds no reference model. The
    log-probs are cached in out_dir/ref_logps.safetensors, keyed on the reference model's and the
    data's content (`cache_key`), and reused on resume; another SFT model computes them again."""
    cache = run.out / CACHE
    ref_path = run.cfg.ref_model_path or run.cfg.model_path
    # the probe's rows are the very objects probe() runs (they receive the log-probs below)
    splits = (
        {"probe": run._worst_case_units()} if run.cfg.probe_steps else {"train": run.train_rows, "eval": run.eval_rows}
    )
    sizes = {k: len(v) for k, v in splits.items()}
    key = None if run.cfg.probe_steps else cache_key(run.cfg, sizes)
    values = load_cached(cache, key)
    if values is None:
        engine = reference_engine(run.cand, ref_path, ds_cfg, run.cfg.qlora_quant_type, run.cfg.mlp_tile_tokens)
        t0 = time.perf_counter()
        values = {
            k: reference_logps(
                engine,
                rows,
                run.pad_id,
                run.cand.micro_batch,
                run.world,
                run.rank,
                run.cand.loss_impl,
                run.cfg.loss_chunk_tokens,
                run.cfg.method,
            )
            for k, rows in splits.items()
        }
        run.log(f"reference log-probs of {sum(sizes.values())} rows precomputed in {time.perf_counter() - t0:.1f} s")
        weights = _storage_refs(engine.module)
        _forget_zero3_module(engine.module)
        engine.destroy()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        left = sum(n for ref, n in weights if ref() is not None)
        run.log(f"reference model released: {left / MIB:.1f} MiB of its parameters still allocated")
        if run.rank == 0 and key is not None:
            save_cached(cache, key, values)
            (run.out / LEGACY_CACHE).unlink(missing_ok=True)
    names = ("ref_logps", "ref_KL_logps") if run.cfg.method == "kto" else ("ref_chosen_logps", "ref_rejected_logps")
    for k, rows in splits.items():
        for row, pair in zip(rows, values[k].tolist(), strict=True):
            row.update(zip(names, pair, strict=True))
