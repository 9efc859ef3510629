"""Pieces of `memfit.train.loop.Run` that depend on the method or the run's length: the frozen
reference engine (DPO and KTO with `ref: model`), the `StepRunner` every step, evaluation and probe
runs, and the warm-up steps a run's steady step time leaves out."""

from __future__ import annotations

from typing import Any

from memfit.space import Candidate
from memfit.train.reference import reference_engine
from memfit.train.run_config import REFERENCE_METHODS, RunConfig
from memfit.train.steps import StepRunner


def frozen_reference(cfg: RunConfig, cand: Candidate, ds_cfg: dict[str, Any]):
    """The reference as a DeepSpeed inference engine when the method has one and the candidate
    keeps it as a model (`ref: model`); None otherwise (adapter, precomputed, no reference)."""
    if cfg.method not in REFERENCE_METHODS or cand.ref != "model":
        return None
    ref = cfg.ref_model_path or cfg.model_path
    return reference_engine(cand, ref, ds_cfg, cfg.qlora_quant_type, cfg.mlp_tile_tokens)


def step_runner(cfg: RunConfig, cand: Candidate, engine, ref_engine, pad_id: int, shard, log=None) -> StepRunner:
    """The run's forward and loss (memfit.train.steps): DPO's and the preference methods'
    hyperparameters from the run config, the loss implementation from the candidate. With
    `kernels: liger` (memfit.train.liger) the policy's RMSNorm, RoPE and SwiGLU become Liger's first
    (instance patches: DeepSpeed's hooks and a regional compile, traced at the first call, see them)
    and the loss runs through Liger's fused linear cross-entropy; `log` gets the line saying so."""
    if cfg.kernels == "liger":
        from memfit.train import liger

        said = liger.apply(getattr(engine, "module", engine))
        if log is not None:
            log(said)
    return StepRunner(
        cfg.method,
        engine,
        ref_engine,
        pad_id,
        dpo=cfg.dpo,
        ref=cand.ref,
        loss_on=cfg.loss_on,
        flatten_packs=cand.attn == "flash",
        loss_impl="liger" if cfg.kernels == "liger" else cand.loss_impl,  # Liger's fused linear cross-entropy
        loss_chunk_tokens=cfg.loss_chunk_tokens,
        shard=shard,
        pref=cfg.pref,
        padding_free=cfg.padding_free,
    )


# the columns each method reads from a prepared dataset (memfit.data.SCHEMAS): rm, orpo and simpo
# train on DPO pairs (rm's margin column is optional), kto on its unpaired rows
COLUMNS = {
    "sft": ("input_ids", "labels"),
    "kto": ("prompt_ids", "completion_ids", "label", "kl_completion_ids"),
}
PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


def check_data(cfg: RunConfig, rows: list[dict[str, Any]]) -> None:
    """RunRefused, before any model is loaded, when the prepared rows lack a column `cfg.method`
    reads: data prepared for another method (its stats.json names that method)."""
    from memfit.train.run_config import RunRefused

    need = COLUMNS.get(cfg.method, PAIR_COLUMNS)
    missing = [c for c in need if rows and c not in rows[0]]
    if missing:
        raise RunRefused(
            f"data_dir {cfg.data_dir} was not prepared for {cfg.method} (its rows lack {', '.join(missing)}; "
            f"its stats.json says which method it was prepared for): prepare the data with method {cfg.method}"
            + (" (kto takes pairs too: each becomes a desirable and an undesirable row)" if cfg.method == "kto" else "")
        )


def warmup_steps(steps: int) -> int:
    """The first steps a run's steady step time leaves out: the first (it allocates the optimizer
    state and DeepSpeed's buckets), and with 4 steps or more the second as well, as the calibrate
    rule does (memfit.train.calibrate.WARMUP_STEPS): ZeRO-3's second step still records its
    parameter-fetch trace, and on one H200 it took 2.33 and 4.17 s where the third took 0.57 and
    0.56 s (benchmarks/results/gpu_check_h200/replay, docs/gpus.md). A 3-step probe keeps two steps."""
    return 2 if steps >= 4 else 1


class StepTime(float):
    """A step's seconds, with the graphs dynamo had compiled by its end (`compile: true`; else 0)."""

    graphs: int

    def __new__(cls, seconds: float, graphs: int = 0) -> StepTime:
        t = super().__new__(cls, seconds)
        t.graphs = graphs
        return t


def steady_step_times(step_times: list[float]) -> list[float]:
    """The steps a run's steady step time is the median of: those after `warmup_steps`, less each
    step that compiled a graph (a `StepTime` whose graph count grew): under `compile`, a batch of a
    new length, or the first without padding, recompiles once (torch.compile's dynamic shapes), and a
    3-step probe of the demo counted such a step at 0.43 s beside the next one's 0.16 s. All the
    steps after the warm-up where every one of them compiled."""
    start = warmup_steps(len(step_times))
    graphs = [getattr(t, "graphs", 0) for t in step_times]
    steady = [t for i, t in enumerate(step_times) if i >= start and not (i and graphs[i] > graphs[i - 1])]
    return steady or step_times[start:] or step_times
