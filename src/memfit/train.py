"""DeepSpeed SFT and DPO training, one rank per process; probes run the same step.

Launch all ranks of a run on one node (what the `train` and `probe_candidate` rules do):

    memfit launch --config results/demo-tiny/cpu/sft/run.json --nproc 2

which runs `python -m torch.distributed.run --standalone --nproc-per-node 2 -m memfit.cli
train --config ...`. On a GPU node `--nproc` is the number of GPUs; under SLURM the
same entry point runs once per task.

The loop reads top to bottom: strategy -> model -> reference -> data -> DeepSpeed ->
resume -> fit -> export (OpenRLHF's `train()` order).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import statistics
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit import checkpoint, dsconfig
from memfit.atomic import replace_dir, write_json_atomic
from memfit.losses import IGNORE_INDEX, DPOConfig, dpo_loss, sequence_logps, sft_loss
from memfit.memory import AllocationTracker, device_peaks, reset_device_peaks
from memfit.space import Candidate

OOM_EXIT_CODE = 3  # a rank that ran out of device memory exits with this after writing its marker
PREEMPTED_EXIT_CODE = 4  # checkpointed on SIGTERM/SIGUSR1; re-run to resume
PREEMPTED_MARKER = "preempted.json"  # written by rank 0 beside the checkpoints; torchrun itself exits 1
_STOP_REQUESTED = threading.Event()


def _request_stop(signum, _frame) -> None:
    _STOP_REQUESTED.set()


@dataclass
class RunConfig:
    """Everything one training (or probe) run needs; written as `run.json` by the workflow."""

    method: str  # sft | dpo
    model_path: str  # HF model directory the policy starts from
    data_dir: str  # output of prepare_data: train.parquet, eval.parquet, stats.json
    out_dir: str  # run directory: metrics.jsonl, checkpoints/, model/
    candidate: dict[str, Any]  # a `Candidate` as a dict: ZeRO, offload, micro batch, seq_len ...
    lr: float = 1e-3  # peak learning rate
    epochs: float = 1.0  # passes over the training rows (ignored when max_steps is set)
    max_steps: int | None = None  # optimizer steps; overrides epochs
    warmup_steps: int = 10  # linear warmup steps
    min_lr_ratio: float = 0.1  # cosine decays to this fraction of lr
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # global gradient-norm clip
    seed: int = 0
    log_every: int = 10  # steps between log lines
    eval_every: int = 50  # steps between held-out evaluations (and at the end)
    save_every: int = 100  # steps between checkpoints (and at the end); 0 disables
    keep_last: int = 2  # checkpoints kept after rotation
    resume: str = "auto"  # auto: newest valid checkpoint in out_dir/checkpoints, else fresh; never; or a checkpoint dir
    stop_after_step: int | None = None  # stop (as if killed) after this step: used to test resume
    export: bool = True  # save the final model to out_dir/model (HF format, safetensors)
    export_format: str = "merged"  # merged: full HF model | adapter: peft adapter only (LoRA/QLoRA)
    loss_on: str = "response"  # SFT: response (prompt tokens masked) | all (prompt too, never padding)
    packing: bool = False  # SFT: pack short rows into sequences of up to seq_len tokens
    lora_alpha: float | None = None  # default 2 * rank
    lora_dropout: float = 0.0
    lora_targets: str | list[str] = "all-linear"  # peft target_modules
    dpo: dict[str, Any] = field(default_factory=dict)  # DPOConfig fields: beta, loss_type, label_smoothing
    ref_model_path: str | None = None  # DPO reference (default: model_path, i.e. the SFT output)
    probe_steps: int = 0  # >0: probe mode: this many steps on the worst-case batch, no checkpoints
    expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (GPU only)

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        d = json.loads(Path(path).read_text())
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{path}: unknown run config keys {unknown}")
        return cls(**d)

    def __post_init__(self) -> None:
        problems = option_problems(self.method, self.loss_on, self.packing, self.export_format,
                                   [self.cand.finetune])
        if problems:
            raise ValueError("invalid run config: " + "; ".join(problems))

    def save(self, path: str | Path) -> None:
        write_json_atomic(Path(path), dataclasses.asdict(self))

    @property
    def cand(self) -> Candidate:
        return Candidate.from_dict(self.candidate)


def option_problems(method: str, loss_on: str, packing: bool, export: str, finetunes: list[str]) -> list[str]:
    """What is wrong with the SFT/export options of a `train.<method>` section, each naming its key
    (the workflow's config check and RunConfig share this)."""
    out = []
    key = f"train.{method}"
    if loss_on not in ("response", "all"):
        out.append(f"{key}.loss_on: {loss_on!r} is not allowed (allowed: 'response', 'all')")
    elif method != "sft" and loss_on != "response":
        out.append(f"{key}.loss_on: {loss_on!r} applies to sft only (DPO always scores the responses)")
    if packing and method != "sft":
        out.append(f"{key}.packing: packing applies to sft only (a DPO pair is scored as one "
                   "chosen/rejected forward); remove it or set it to false")
    if export not in ("merged", "adapter"):
        out.append(f"{key}.export: {export!r} is not allowed (allowed: 'merged', 'adapter')")
    elif export == "adapter":
        full = sorted({f for f in finetunes if f not in ("lora", "qlora")})
        if full:
            out.append(f"{key}.export: 'adapter' needs finetune lora or qlora (search.finetune lists "
                       f"{', '.join(full)}: a full fine-tune has no adapter); use export: merged")
    return out


# --------------------------------------------------------------------------- distributed
def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _init_distributed() -> None:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    # gloo on the CPU accelerator (ccl only where oneCCL is installed), nccl on CUDA.
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def _all_reduce_sum(values: list[float]) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def _all_reduce_max(values: list[float]) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _device() -> torch.device:
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", "0"))))


# --------------------------------------------------------------------------- model
ATTN_IMPL = {"flash": "flash_attention_2", "sdpa": "sdpa", "eager": "eager"}
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def check_hardware(cand: Candidate) -> None:
    """Refuse what this machine cannot run, before loading anything."""
    if cand.attn == "flash":
        if not torch.cuda.is_available():
            raise RuntimeError("attn=flash needs a CUDA GPU (FlashAttention-2); use sdpa or eager on the CPU")
        major, _ = torch.cuda.get_device_capability()
        if major < 8:  # FlashAttention-2 README: Ampere, Ada or Hopper (sm80+)
            raise RuntimeError("attn=flash needs compute capability >= 8.0 (FlashAttention-2)")
        try:
            import flash_attn  # noqa: F401
        except ImportError as e:
            raise RuntimeError("attn=flash needs the flash-attn package (pip install '.[gpu]')") from e
    if cand.precision == "bf16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        raise RuntimeError("bf16 is not supported on this GPU (needs Ampere or newer); use fp16")
    if cand.finetune == "qlora" and not torch.cuda.is_available():
        raise RuntimeError("finetune=qlora needs bitsandbytes on a CUDA GPU; it cannot run on the CPU")


ADAPTER_CONFIG = "adapter_config.json"  # what peft's save_pretrained writes beside the adapter weights


def adapter_base(path: str | Path) -> str | None:
    """The base model directory of an adapter-only export (`export: adapter`), from peft's
    adapter_config.json; None for a full model directory. memfit never downloads, so the base must
    be a local model directory (a relative path is read from the working directory)."""
    p = Path(path)
    if (p / "config.json").exists() or not (p / ADAPTER_CONFIG).exists():
        return None
    base = json.loads((p / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").exists():
        raise FileNotFoundError(
            f"{p / ADAPTER_CONFIG}: base_model_name_or_path {base!r} is not a local model directory "
            f"(no config.json; relative paths are read from {os.getcwd()}). An adapter-only export "
            "needs the base model it was trained on: restore it there, or export merged "
            "(train.<method>.export: merged)."
        )
    return base


def model_dir(path: str | Path) -> str:
    """Where a model's config.json lives: the base model's directory for an adapter-only export."""
    return adapter_base(path) or str(path)


def _merge_adapter(model, adapter_dir: str):
    """`model` with the adapter saved in `adapter_dir` merged into its weights (peft's own merge).
    Under ZeRO-3 (weights partitioned as they loaded) each adapted layer's weight is gathered,
    merged on rank 0 and partitioned again (DeepSpeed's GatheredParameters(modifier_rank=0))."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    peft_model = PeftModel.from_pretrained(model, adapter_dir)
    if not any(hasattr(p, "ds_id") for p in model.parameters()):
        return peft_model.merge_and_unload()
    import deepspeed
    import torch.distributed as dist

    for m in peft_model.modules():
        if isinstance(m, LoraLayer):
            with deepspeed.zero.GatheredParameters([m.get_base_layer().weight], modifier_rank=0):
                if dist.get_rank() == 0:
                    m.merge()
    return peft_model.unload()  # drops the (merged) adapter modules on every rank


def load_model(path: str, cand: Candidate, trainable: bool, lora: dict[str, Any] | None = None):
    """A HF causal LM with the candidate's attention, dtype, checkpointing and adapters.

    `path` may be an adapter-only export (adapter_config.json, no config.json): the base model it
    names is loaded and the adapter merged in, so DPO can start from an SFT run that exported
    `adapter` exactly as from one that exported `merged`.
    """
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"attn_implementation": ATTN_IMPL[cand.attn], "dtype": DTYPE[cand.precision]}
    if cand.finetune == "qlora" and trainable:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=DTYPE[cand.precision],
            # peft's ZeRO-3 + QLoRA recipe: a storage dtype ZeRO-3 can shard.
            bnb_4bit_quant_storage=DTYPE[cand.precision],
        )
    base = adapter_base(path)
    model = AutoModelForCausalLM.from_pretrained(base or path, **kwargs)
    if base is not None:
        model = _merge_adapter(model, path)
        for p in model.parameters():  # peft froze the base weights; a full fine-tune trains them
            if p.is_floating_point():
                p.requires_grad_(True)
    model.config.use_cache = False
    if not trainable:
        model.eval()
        model.requires_grad_(False)
        return model
    if cand.grad_ckpt:
        # Non-reentrant checkpointing works with frozen inputs (LoRA) and ZeRO-3 hooks.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cand.finetune in ("lora", "qlora"):
        from peft import LoraConfig, get_peft_model

        lora = lora or {}
        model = get_peft_model(
            model,
            LoraConfig(
                r=cand.lora_rank,
                lora_alpha=lora.get("alpha") or 2 * cand.lora_rank,
                lora_dropout=lora.get("dropout", 0.0),
                target_modules=lora.get("targets", "all-linear"),
                task_type="CAUSAL_LM",
            ),
        )
        if cand.grad_ckpt:
            model.enable_input_require_grads()
    return model


# --------------------------------------------------------------------------- data
def _load_rows(data_dir: str, split: str) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return pq.read_table(Path(data_dir) / f"{split}.parquet").to_pylist()


def _pad(seqs: list[list[int]], value: int, length: int | None = None) -> torch.Tensor:
    n = length or max(len(s) for s in seqs)
    out = torch.full((len(seqs), n), value, dtype=torch.long)
    for i, s in enumerate(seqs):
        s = s[:n]
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def collate(method: str, rows: list[dict[str, Any]], pad_id: int, pad_to: int | None = None,
            loss_on: str = "response") -> dict[str, torch.Tensor]:
    """Right-padded tensors. DPO: chosen rows then rejected rows, one forward (OpenRLHF's concatenated_forward).

    SFT `loss_on`: response scores the response tokens only (the prepared labels); all scores
    every token of the row, prompt included (labels = input_ids); padding is never scored.
    """
    if method == "sft":
        ids = [r["input_ids"] for r in rows]
        labels = [r["input_ids"] if loss_on == "all" else r["labels"] for r in rows]
    else:
        ids, labels = [], []
        for key in ("chosen_ids", "rejected_ids"):
            for r in rows:
                p, y = list(r["prompt_ids"]), list(r[key])
                ids.append(p + y)
                labels.append([IGNORE_INDEX] * len(p) + y)
    input_ids = _pad(ids, pad_id, pad_to)
    return {
        "input_ids": input_ids,
        "labels": _pad(labels, IGNORE_INDEX, pad_to),
        "attention_mask": _pad([[1] * len(s) for s in ids], 0, pad_to),
    }


def collate_packed(packs: list[list[dict[str, Any]]], pad_id: int, pad_to: int | None = None,
                   loss_on: str = "response", flatten: bool = False) -> dict[str, torch.Tensor]:
    """SFT packs (each a list of rows, concatenated) as input_ids, labels and position_ids; no
    attention_mask, on purpose.

    position_ids restart at 0 at every row. With no attention mask, transformers 5 reads packed
    sequences from them (masking_utils.find_packed_sequence_indices: a new sequence wherever a
    position is not the previous one + 1) and builds a block-diagonal causal mask for sdpa and
    eager, so no token attends across a row boundary; flash_attention_2 derives cu_seqlens from
    them (modeling_flash_attention_utils._is_packed_sequence / prepare_fa_kwargs_from_position_ids)
    but only for batch size 1, hence `flatten` ([1, B*L]) for flash. Padding at the end of a
    pack is a sequence of its own (positions from 0) and never a target. The first token of
    each row is never a target: unpacked nothing predicts it, packed the previous row's last
    token would. RoPE sees the same positions as unpacked, so the loss equals the unpacked one.
    """
    ids, labels, pos = [], [], []
    for pack in packs:
        i: list[int] = []
        y: list[int] = []
        q: list[int] = []
        for r in pack:
            x = list(r["input_ids"])
            t = x if loss_on == "all" else list(r["labels"])
            i += x
            y += [IGNORE_INDEX] + t[1:]
            q += range(len(x))
        ids.append(i)
        labels.append(y)
        pos.append(q)
    n = pad_to or max(len(s) for s in ids)
    if max(len(s) for s in ids) > n:
        raise ValueError(f"a pack of {max(len(s) for s in ids)} tokens does not fit pad_to={n}")
    out = {
        "input_ids": _pad(ids, pad_id, n),
        "labels": _pad(labels, IGNORE_INDEX, n),
        "position_ids": _pad([q + list(range(n - len(q))) for q in pos], 0, n),
    }
    if flatten:
        out = {k: v.reshape(1, -1) for k, v in out.items()}
    return out


class Schedule:
    """Which rows each rank sees at each step: a pure function of (seed, step), so resume is exact.

    Each epoch is a fresh permutation (seed + epoch); a step consumes one global batch
    (micro_batch x grad_accum x world) in order; the tail of an epoch shorter than a
    global batch is skipped (counted in `rows_skipped_per_epoch`).
    """

    def __init__(self, n_rows: int, micro: int, accum: int, world: int, seed: int, unit: str = "training rows") -> None:
        self.n, self.micro, self.accum, self.world, self.seed = n_rows, micro, accum, world, seed
        self.global_batch = micro * accum * world
        self.steps_per_epoch = n_rows // self.global_batch
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"{n_rows} {unit} are fewer than one global batch "
                f"({micro} micro x {accum} accum x {world} ranks = {self.global_batch})"
            )
        self.rows_skipped_per_epoch = n_rows - self.steps_per_epoch * self.global_batch
        self._perm: tuple[int, np.ndarray] | None = None

    def micro_batches(self, step: int, rank: int) -> Iterator[list[int]]:
        epoch, k = divmod(step, self.steps_per_epoch)
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng(self.seed + epoch).permutation(self.n))
        base = k * self.global_batch
        for m in range(self.accum):
            start = base + (m * self.world + rank) * self.micro
            yield self._perm[1][start : start + self.micro].tolist()


# --------------------------------------------------------------------------- one step
class StepRunner:
    """Forward + loss for one micro batch; the same code for training, evaluation and probes."""

    def __init__(self, cfg: RunConfig, engine, ref_engine, pad_id: int) -> None:
        self.cfg, self.engine, self.ref, self.pad_id = cfg, engine, ref_engine, pad_id
        self.method = cfg.method
        self.dpo = DPOConfig(**cfg.dpo) if cfg.method == "dpo" else None
        self.device = _device()
        # read with defaults: benchmarks and the TRL parity test drive the runner with a bare namespace
        self.loss_on = getattr(cfg, "loss_on", "response")
        self.flatten_packs = getattr(cfg, "cand", None) is not None and getattr(cfg.cand, "attn", None) == "flash"

    def loss(self, rows: list[Any], pad_to: int | None = None, packed: bool = False) -> tuple[torch.Tensor, dict[str, float], int]:
        """Mean loss over the micro batch, summed metrics (to average later) and non-padding tokens.

        packed (SFT): `rows` are packs (lists of rows), see `collate_packed`.
        """
        if packed:
            batch = {k: v.to(self.device) for k, v in collate_packed(rows, self.pad_id, pad_to, self.loss_on, self.flatten_packs).items()}
            out = self.engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
            loss, _ = sft_loss(out.logits, batch["labels"])
            return loss, {"loss": loss.item() * len(rows)}, sum(len(r["input_ids"]) for p in rows for r in p)
        batch = {k: v.to(self.device) for k, v in collate(self.method, rows, self.pad_id, pad_to, self.loss_on).items()}
        out = self.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        tokens = int(batch["attention_mask"].sum())
        if self.method == "sft":
            loss, _ = sft_loss(out.logits, batch["labels"])
            return loss, {"loss": loss.item() * len(rows)}, tokens
        assert self.dpo is not None
        logps, lengths = sequence_logps(out.logits, batch["labels"])
        n = len(rows)
        if self.cfg.cand.ref == "precomputed":
            ref = torch.tensor(
                [r["ref_chosen_logps"] for r in rows] + [r["ref_rejected_logps"] for r in rows],
                device=logps.device,
                dtype=logps.dtype,
            )
        else:
            with torch.no_grad():
                if self.cfg.cand.ref == "adapter":
                    with self.engine.module.disable_adapter():
                        ref_out = self.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                else:
                    ref_out = self.ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                ref, _ = sequence_logps(ref_out.logits, batch["labels"])
        losses, metrics = dpo_loss(logps[:n], logps[n:], ref[:n], ref[n:], self.dpo, lengths[:n], lengths[n:])
        sums = {"loss": float(losses.detach().sum())} | {k: float(v.sum()) for k, v in metrics.items()}
        return losses.mean(), sums, tokens


# --------------------------------------------------------------------------- the run
class Run:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.cand = cfg.cand
        self.rank, self.world = _rank(), _world()
        self.out = Path(cfg.out_dir)
        self.ckpt_root = self.out / "checkpoints"
        self.metrics_path = self.out / "metrics.jsonl"

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, file=sys.stderr, flush=True)

    def setup(self) -> None:
        import deepspeed
        from transformers import AutoTokenizer

        cfg, cand = self.cfg, self.cand
        check_hardware(cand)
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

        self.train_rows = _load_rows(cfg.data_dir, "train")
        self.eval_rows = _load_rows(cfg.data_dir, "eval")
        # What a step draws: rows, or with packing packed sequences (global_batch counts those).
        self.train_units: list[Any] = self.train_rows
        self.packing: dict[str, Any] | None = None
        if cfg.packing:
            self.train_units, self.packing = self._pack()
        self.schedule = Schedule(len(self.train_units), cand.micro_batch, cand.grad_accum, self.world, cfg.seed,
                                 unit="packed sequences (train.sft.packing)" if cfg.packing else "training rows")
        if cfg.probe_steps:
            self.total_steps = cfg.probe_steps
        elif cfg.max_steps:
            self.total_steps = cfg.max_steps
        else:
            self.total_steps = max(1, math.floor(cfg.epochs * self.schedule.steps_per_epoch))

        ds_cfg = dsconfig.build(
            cand,
            self.world,
            lr=cfg.lr,
            total_steps=self.total_steps,
            warmup_steps=min(cfg.warmup_steps, self.total_steps // 2),
            weight_decay=cfg.weight_decay,
            grad_clip=cfg.grad_clip,
            min_lr_ratio=cfg.min_lr_ratio,
            hidden_size=_hidden_size(model_dir(cfg.model_path)),
        )
        self.ds_config = ds_cfg
        if cfg.method == "dpo" and cand.ref == "precomputed":
            self._precompute_reference(ds_cfg)
        hf_ds = None
        if cand.zero == 3:
            from transformers.integrations import HfDeepSpeedConfig

            # Keeps a global weakref that makes from_pretrained partition weights as it loads
            # (zero.Init): no rank ever holds the whole model. Must stay alive until initialize.
            hf_ds = HfDeepSpeedConfig(ds_cfg)
        # which checkpoint a resume reads, refused here (before any model is loaded) when it is
        # another run's; a universal load is a DeepSpeed config key, so it is decided before initialize
        self.resume_plan = None if cfg.probe_steps else self._plan_resume()
        if self.resume_plan and self.resume_plan[2] == checkpoint.UNIVERSAL_LOAD:
            ds_cfg["checkpoint"] = {"load_universal": True}  # config-json.md, "Checkpoint options"
        lora = {"alpha": cfg.lora_alpha, "dropout": cfg.lora_dropout, "targets": cfg.lora_targets}
        model = load_model(cfg.model_path, cand, trainable=True, lora=lora)
        params = [p for p in model.parameters() if p.requires_grad]
        self.engine, _, _, self.scheduler = deepspeed.initialize(model=model, model_parameters=params, config=ds_cfg)
        # WarmupCosineLR starts at last_batch_iteration=-1, where get_lr_ratio() is 0, and the
        # engine steps it only after each optimizer step (deepspeed/runtime/lr_schedules.py,
        # engine.py _take_model_step): without this step the first step would train at lr 0 and
        # every later one a step behind the schedule. After it, step k uses the schedule's value
        # at k-1, as transformers' get_cosine_schedule_with_warmup does.
        if self.scheduler is not None and self.scheduler.last_batch_iteration < 0:
            self.scheduler.step()

        self.ref_engine = None
        if cfg.method == "dpo" and cand.ref == "model":
            self.ref_engine = self._reference_engine(ds_cfg)
        del hf_ds
        self.runner = StepRunner(cfg, self.engine, self.ref_engine, self.pad_id)

    def _pack(self) -> tuple[list[list[dict[str, Any]]], dict[str, Any]]:
        """SFT packing: the training rows in packs of at most seq_len tokens (memfit.data.pack)."""
        from memfit.data import pack

        cap = self.cand.seq_len
        lengths = [len(r["input_ids"]) for r in self.train_rows]
        if max(lengths) > cap:
            raise ValueError(
                f"train.sft.packing: a training row has {max(lengths)} tokens, more than the "
                f"candidate's seq_len {cap} a pack holds; set search.seq_len >= data.max_len (or null)"
            )
        packs = pack(lengths, cap, self.cfg.seed)
        units = [[self.train_rows[i] for i in p] for p in packs]
        stats = {
            "rows": len(lengths),
            "packs": len(packs),
            "capacity": cap,
            "rows_per_pack": round(len(lengths) / len(packs), 3),
            "fill": round(sum(lengths) / (len(packs) * cap), 4),  # real tokens / pack slots
        }
        self.log(f"packing: {stats['rows']} rows into {stats['packs']} sequences of <= {cap} tokens "
                 f"({stats['rows_per_pack']} rows each, {stats['fill']:.1%} filled)")
        return units, stats

    def _reference_engine(self, ds_cfg: dict[str, Any]):
        """The frozen DPO reference as a DeepSpeed inference engine."""
        import deepspeed

        cand = self.cand
        ref_path = self.cfg.ref_model_path or self.cfg.model_path
        ref_cfg = {
            "train_micro_batch_size_per_gpu": cand.micro_batch,
            "gradient_accumulation_steps": cand.grad_accum,
            "bf16": ds_cfg["bf16"],
            "fp16": ds_cfg["fp16"],
            # The frozen reference is sharded like the policy under ZeRO-3 (OpenRLHF's
            # get_eval_ds_config); ZeRO 0-2 keep a full replica per rank.
            "zero_optimization": {"stage": 3 if cand.zero == 3 else 0},
        }
        if cand.zero == 3 and (h := _hidden_size(model_dir(ref_path))):
            # the same persistence threshold and prefetch bucket as the policy's
            ref_cfg["zero_optimization"].update(dsconfig.bucket_sizes(h, 3))
            ref_cfg["zero_optimization"].pop("reduce_bucket_size", None)
        if cand.zero == 3 and cand.offload_param != "none":
            ref_cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": cand.pin_memory}
        ref_hf = None
        if cand.zero == 3:
            from transformers.integrations import HfDeepSpeedConfig

            ref_hf = HfDeepSpeedConfig(ref_cfg)  # from_pretrained partitions the reference as it loads
        ref_model = load_model(ref_path, dataclasses.replace(cand, grad_ckpt=False), trainable=False)
        engine = deepspeed.initialize(model=ref_model, config=ref_cfg)[0]
        engine.eval()
        del ref_hf
        return engine

    def _precompute_reference(self, ds_cfg: dict[str, Any]) -> None:
        """ref=precomputed: one inference pass of the reference over every row (only the worst-case
        rows for a probe) before the policy exists, so training holds no reference model. The
        log-probs are cached in out_dir/ref_logps.pt and reused on resume."""
        import gc

        cache = self.out / "ref_logps.pt"
        ref_path = self.cfg.ref_model_path or self.cfg.model_path
        splits = {"probe": self._worst_case_rows()} if self.cfg.probe_steps else {"train": self.train_rows, "eval": self.eval_rows}
        sizes = {k: len(v) for k, v in splits.items()}
        stored = torch.load(cache, weights_only=False) if cache.exists() else None
        if stored is None or stored["ref_path"] != ref_path or stored["sizes"] != sizes:
            engine = self._reference_engine(ds_cfg)
            t0 = time.perf_counter()
            values = {k: self._reference_logps(engine, rows) for k, rows in splits.items()}
            self.log(f"reference log-probs of {sum(sizes.values())} rows precomputed in {time.perf_counter() - t0:.1f} s")
            weights = _storage_refs(engine.module)
            _forget_zero3_module(engine.module)
            engine.destroy()
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            left = sum(n for ref, n in weights if ref() is not None)
            self.log(f"reference model released: {left / 2**20:.1f} MiB of its parameters still allocated")
            stored = {"ref_path": ref_path, "sizes": sizes, "values": values}
            if self.rank == 0 and not self.cfg.probe_steps:
                self.out.mkdir(parents=True, exist_ok=True)
                torch.save(stored, self.out / "ref_logps.pt.tmp")
                os.replace(self.out / "ref_logps.pt.tmp", cache)
        for k, rows in splits.items():
            for row, (chosen, rejected) in zip(rows, stored["values"][k].tolist(), strict=True):
                row["ref_chosen_logps"], row["ref_rejected_logps"] = chosen, rejected

    def _rank_batches(self, rows: list[dict[str, Any]]) -> Iterator[tuple[list[int], list[dict[str, Any]]]]:
        """This rank's share of `rows` in micro batches: micro batch j is rows [j*micro, (j+1)*micro)
        and runs on rank j % world, so which rows share a batch (hence padding and the per-batch
        token mean an eval loss is built from) does not depend on the number of ranks: a run
        resumed on another world size evaluates the same batches. Every rank yields the same
        number of batches, a rank that ran out gets ([], [rows[0]]) as a dummy: ZeRO-3's forward
        all-gathers parameters, so all ranks must run the same number of forwards."""
        micro = self.cand.micro_batch
        total = math.ceil(len(rows) / micro)
        for b in range(math.ceil(total / self.world)):
            j = b * self.world + self.rank
            idx = list(range(j * micro, min((j + 1) * micro, len(rows)))) if j < total else []
            yield idx, ([rows[i] for i in idx] if idx else [rows[0]])

    def _reference_logps(self, engine, rows: list[dict[str, Any]]) -> torch.Tensor:
        """[len(rows), 2] summed log-probs (chosen, rejected); ranks split the rows, then all-reduce."""
        out = torch.zeros(len(rows), 2, dtype=torch.float64)
        device = _device()
        with torch.no_grad():
            for idx, batch_rows in self._rank_batches(rows):
                batch = {k: v.to(device) for k, v in collate("dpo", batch_rows, self.pad_id).items()}
                logits = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                lp, _ = sequence_logps(logits, batch["labels"])
                n = len(batch_rows)
                if idx:
                    out[idx, 0] = lp[:n].double().cpu()
                    out[idx, 1] = lp[n:].double().cpu()
        totals = _all_reduce_sum(out.flatten().tolist())  # each row was filled by exactly one rank
        return torch.tensor(totals, dtype=torch.float64).view(len(rows), 2)

    # -- evaluation ----------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Means over every held-out row; every rank runs the same number of forwards (ZeRO-3)."""
        sums: dict[str, float] = {}
        count = 0.0
        self.engine.eval()
        with torch.no_grad():
            for idx, batch in self._rank_batches(self.eval_rows):
                real = len(idx)
                loss, m, _ = self.runner.loss(batch)
                if real:
                    for k, v in m.items():
                        sums[k] = sums.get(k, 0.0) + v
                    count += real
        self.engine.train()
        keys = sorted(sums) if sums else ["loss"]
        totals = _all_reduce_sum([sums.get(k, 0.0) for k in keys] + [count])
        n = max(totals[-1], 1.0)
        return {k: totals[i] / n for i, k in enumerate(keys)}

    # -- one optimizer step --------------------------------------------------
    def train_step(self, step: int, probe_rows: list[dict[str, Any]] | None) -> dict[str, float]:
        t0 = time.perf_counter()
        sums: dict[str, float] = {}
        rows_seen = 0
        tokens = 0
        for idx in self.schedule.micro_batches(step, self.rank):
            rows = probe_rows if probe_rows is not None else [self.train_units[i] for i in idx]
            pad_to = self.cand.seq_len if probe_rows is not None else None
            loss, m, tok = self.runner.loss(rows, pad_to=pad_to, packed=self.cfg.packing)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite loss {float(loss)} at step {step + 1} on rank {self.rank}")
            self.engine.backward(loss)
            self.engine.step()
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v
            rows_seen += len(rows)
            tokens += tok
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        keys = sorted(sums)
        totals = _all_reduce_sum([sums[k] for k in keys] + [rows_seen])
        out = {k: totals[i] / totals[-1] for i, k in enumerate(keys)}
        out["tokens_per_s"] = tokens / dt  # non-padding tokens per second, this rank
        out["step_time_s"] = dt
        return out

    # -- the loop -------------------------------------------------------------
    def _stop_signal_received(self) -> bool:
        """True on every rank once any rank got SIGTERM/SIGUSR1 (one all-reduce per step)."""
        return bool(_all_reduce_max([float(_STOP_REQUESTED.is_set())])[0])

    def fit(self) -> dict[str, Any]:
        from tqdm import tqdm

        cfg = self.cfg
        # from_pretrained returns the model in eval mode (transformers modeling_utils.py), and
        # transformers checkpoints a layer only when `self.gradient_checkpointing and
        # self.training` (modeling_layers.py GradientCheckpointingLayer), LoRA dropout likewise:
        # without this, probes and any run before its first evaluation trained in eval mode.
        self.engine.train()
        tracker = None if torch.cuda.is_available() else AllocationTracker(_device())
        reset_device_peaks()
        if tracker is not None:
            tracker.__enter__()
        start_step = 0
        self.resume_peak: dict[str, int] | None = None
        if not cfg.probe_steps:
            if self.rank == 0:
                (self.out / PREEMPTED_MARKER).unlink(missing_ok=True)
            start_step = self.maybe_resume()
            if start_step:
                # what loading the checkpoint cost, kept apart from the training peak
                pk = device_peaks(tracker)
                alloc, reserved, rss = _all_reduce_max([pk.allocated, pk.reserved or 0, pk.host_rss])
                self.resume_peak = {"allocated": int(alloc), "reserved": int(reserved), "host_rss": int(rss)}
                if tracker is not None:
                    tracker.reset_peak()
                reset_device_peaks()
        probe_rows = self._worst_case_units() if cfg.probe_steps else None

        step_times: list[float] = []
        peaks: list[tuple[int, int | None]] = []
        bar = tqdm(
            total=self.total_steps,
            initial=start_step,
            desc=f"{cfg.method}{' probe' if cfg.probe_steps else ''}",
            disable=self.rank != 0,
            file=sys.stderr,
            mininterval=2.0,
        )
        try:
            if start_step == 0 and not cfg.probe_steps and self.eval_rows:
                self._write_metrics({"step": 0, "split": "eval", **self.evaluate()})
            for step in range(start_step, self.total_steps):
                lr = float(self.scheduler.get_last_lr()[0]) if self.scheduler else cfg.lr  # what this step uses
                m = self.train_step(step, probe_rows)
                pk = device_peaks(tracker)
                peaks.append((pk.allocated, pk.reserved))
                step_times.append(m["step_time_s"])
                done = step + 1
                alloc, reserved, rss = _all_reduce_max([pk.allocated, pk.reserved or 0, pk.host_rss])
                row = {
                    "step": done,
                    "split": "train",
                    **m,
                    "lr": lr,
                    "grad_norm": _float_or_none(self.engine.get_global_grad_norm()),
                    "peak_allocated_bytes": int(alloc),
                    "peak_reserved_bytes": int(reserved) if pk.reserved is not None else None,
                    "host_rss_bytes": int(rss),
                }
                if not cfg.probe_steps:
                    self._write_metrics(row)
                    if done % cfg.log_every == 0 or done == self.total_steps:
                        self.log(_log_line(row))
                    if cfg.eval_every and (done % cfg.eval_every == 0 or done == self.total_steps) and self.eval_rows:
                        ev = self.evaluate()
                        self._write_metrics({"step": done, "split": "eval", **ev})
                        self.log(f"step {done}: eval " + ", ".join(f"{k} {v:.4f}" for k, v in ev.items()))
                    if cfg.save_every and (done % cfg.save_every == 0 or done == self.total_steps):
                        self.save(done)
                bar.update(1)
                if not cfg.probe_steps and self._stop_signal_received():
                    # SLURM sends SIGTERM (or --signal=USR1@secs) before the wall-time kill:
                    # checkpoint now, exit non-zero, and the re-run resumes from here.
                    if not (cfg.save_every and done % cfg.save_every == 0):
                        self.save(done)
                    self.log(f"signal received: checkpointed step {done}; exiting to be resumed")
                    if self.rank == 0:
                        write_json_atomic(self.out / PREEMPTED_MARKER, {"step": done})
                    raise SystemExit(PREEMPTED_EXIT_CODE)
                if cfg.stop_after_step is not None and done >= cfg.stop_after_step:
                    self.log(f"stopping after step {done} (stop_after_step)")
                    return {"stopped_at": done}
        finally:
            bar.close()
            if tracker is not None:
                tracker.__exit__(None, None, None)
        summary = self._summary(step_times, peaks)
        if cfg.probe_steps:
            return summary
        if cfg.export:
            self.export()
        return summary

    def _summary(self, step_times: list[float], peaks: list[tuple[int, int | None]]) -> dict[str, Any]:
        alloc = max((p[0] for p in peaks), default=0)
        reserved = max((p[1] or 0 for p in peaks), default=0)
        rss = device_peaks(None).host_rss
        mx = _all_reduce_max([alloc, reserved, rss])
        host_sum = _all_reduce_sum([rss])[0]
        steady = step_times[1:] or step_times
        return {
            "world_size": self.world,
            "steps": len(step_times),
            "peak_allocated_bytes": int(mx[0]),
            "peak_reserved_bytes": int(mx[1]) if torch.cuda.is_available() else None,
            "host_rss_bytes_max_rank": int(mx[2]),
            "host_rss_bytes_node": int(host_sum),
            "first_step_time_s": step_times[0] if step_times else None,
            "step_time_s": statistics.median(steady) if steady else None,
            "device": str(_device()),
            "memory_source": "torch.cuda.max_memory_allocated" if torch.cuda.is_available() else "AllocationTracker (live tensor storages)",
            # loading a checkpoint (resumed runs only): device peak while DeepSpeed loaded the shards
            # and host RSS (the process's peak so far) right after; training peaks exclude it
            "resume_peak_allocated_bytes": self.resume_peak["allocated"] if self.resume_peak else None,
            "resume_peak_reserved_bytes": (self.resume_peak["reserved"] or None) if self.resume_peak else None,
            "resume_host_rss_bytes": self.resume_peak["host_rss"] if self.resume_peak else None,
            "packing": self.packing,  # SFT packing: rows, packs, capacity, rows_per_pack, fill; else None
        }

    def _worst_case_rows(self) -> list[dict[str, Any]]:
        stats = json.loads((Path(self.cfg.data_dir) / "stats.json").read_text())
        idx = stats["worst_case_rows"][: self.cand.micro_batch]
        rows = [self.train_rows[i] for i in idx]
        while len(rows) < self.cand.micro_batch:
            rows.append(rows[len(rows) % len(idx)])
        return rows

    def _worst_case_units(self) -> list[Any]:
        """The probe's micro batch: the longest rows, or with packing the fullest packs, each
        padded to seq_len by the caller, so the probe runs the largest shape training can meet
        through the same (packed or padded) code path."""
        if not self.cfg.packing:
            return self._worst_case_rows()
        size = [sum(len(r["input_ids"]) for r in p) for p in self.train_units]
        fullest = sorted(range(len(size)), key=lambda i: (-size[i], i))[: self.cand.micro_batch]
        return [self.train_units[fullest[k % len(fullest)]] for k in range(self.cand.micro_batch)]

    # -- metrics, checkpoints, export ---------------------------------------
    def _write_metrics(self, row: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def save(self, step: int) -> None:
        checkpoint.save(
            self.engine,
            self.ckpt_root,
            step,
            client_state={"step": step, "consumed_samples": step * self.schedule.global_batch},
            keep_last=self.cfg.keep_last,
            run_config=dataclasses.asdict(self.cfg),
            expected_bytes=self._checkpoint_bytes(),
            metrics=self.metrics_path,
        )

    def _checkpoint_bytes(self) -> int:
        """What the first checkpoint writes: 16-bit (or fp32) weights plus fp32 master weights and
        two Adam moments for the trainable ones (12 bytes/param, ZeRO paper Sec. 3.1)."""
        params = list(self.engine.module.parameters())
        total = sum(getattr(p, "ds_numel", p.numel()) for p in params)
        trainable = sum(getattr(p, "ds_numel", p.numel()) for p in params if p.requires_grad)
        return total * DTYPE[self.cand.precision].itemsize + trainable * 12

    def _plan_resume(self) -> tuple[Path, str, str] | None:
        """(checkpoint root, tag, how it loads: checkpoint.SAME/DIRECT/UNIVERSAL_LOAD) or None for
        a fresh start. Raises when the checkpoint is another run's or cannot follow this world size."""
        cfg = self.cfg
        if cfg.resume == "never":
            return None
        if cfg.resume == "auto":
            found = checkpoint.latest_valid(self.ckpt_root, log=self.log)
            if found is None:
                return None
            root, tag = found
        else:
            p = Path(cfg.resume)
            root, tag = p.parent, p.name
        meta = json.loads((root / tag / "memfit.json").read_text())
        return root, tag, checkpoint.check_compatible(meta, dataclasses.asdict(cfg), root / tag, world=self.world)

    def maybe_resume(self) -> int:
        cfg = self.cfg
        if self.resume_plan is None:
            if cfg.resume == "auto" and self.rank == 0 and self.metrics_path.exists():
                self.metrics_path.unlink()  # a fresh start must not append to a dead run's curve
            return 0
        root, tag, mode = self.resume_plan
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        if mode == checkpoint.UNIVERSAL_LOAD:
            need = checkpoint.resume_host_bytes(root, tag, mode)
            if "convert" in need:  # rank 0 alone converts; the node's other ranks only wait
                checkpoint.ensure_host_ram(need["convert"], root / tag, "converting it to a universal checkpoint")
            checkpoint.ensure_universal(root, tag, log=self.log)
        need = checkpoint.resume_host_bytes(root, tag, mode)
        checkpoint.ensure_host_ram(
            ranks_here * need["per_rank"],
            root / tag,
            f"loading it ({ranks_here} ranks x {need['per_rank'] / 2**30:.2f} GiB read to the CPU per rank)",
        )
        state = checkpoint.load(self.engine, root, tag, run_config=dataclasses.asdict(cfg), mode=mode, seed=cfg.seed)
        step = int(state["step"])
        if self.rank == 0:
            checkpoint.restore_metrics(self.metrics_path, step, root / tag)
        how = ""
        if mode != checkpoint.SAME:
            how = (f" (written by {state['world_size']} ranks, now {self.world}: "
                   f"{'universal checkpoint' if mode == checkpoint.UNIVERSAL_LOAD else 'unpartitioned state'}, "
                   "RNG reseeded from (seed, step, rank))")
        self.log(f"resumed from {root / tag} at step {step}{how}")
        return step

    def export(self) -> None:
        """Final model in HF format (safetensors). ZeRO-3 gathers the partitioned weights first."""
        if self.cfg.export_format == "adapter":
            self._export_adapter()
            return
        import torch.distributed as dist

        dest = self.out / "model"
        module = self.engine.module
        if self.cand.zero == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict()  # collective: every rank calls
        else:
            state = None
        if self.rank == 0:
            tmp = self.out / "model.tmp"
            if tmp.exists():
                import shutil

                shutil.rmtree(tmp)
            if self.cand.finetune in ("lora", "qlora") and state is not None:
                # ZeRO-3: the module's weights are partitioned (shape [0]) and cannot take the
                # consolidated state; merge in the gathered state dict instead.
                module.get_base_model().save_pretrained(tmp, state_dict=_merged_lora_state(module, state), safe_serialization=True)
            elif self.cand.finetune in ("lora", "qlora"):
                merged = module.merge_and_unload()
                merged.save_pretrained(tmp, safe_serialization=True)
            else:
                module.save_pretrained(tmp, state_dict=state, safe_serialization=True)
            self.tokenizer.save_pretrained(tmp)
            replace_dir(tmp, dest)
        if dist.is_initialized():
            dist.barrier()


    def _export_adapter(self) -> None:
        """LoRA/QLoRA adapter only: peft's adapter_model.safetensors + adapter_config.json (+ the
        tokenizer) in out_dir/model, written to model.tmp and renamed into place. Only the
        trainable (adapter) weights are gathered under ZeRO-3: GatheredParameters over those, not
        the whole model that _zero3_consolidated_16bit_state_dict would collect."""
        import torch.distributed as dist

        module = self.engine.module
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if self.cand.zero == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):  # collective
                state = {n: p.detach().cpu().clone() for n, p in named} if self.rank == 0 else None
        else:
            state = {n: p.detach().cpu().clone() for n, p in named} if self.rank == 0 else None
        if self.rank == 0:
            tmp = self.out / "model.tmp"
            if tmp.exists():
                import shutil

                shutil.rmtree(tmp)
            module.save_pretrained(tmp, state_dict=state, safe_serialization=True, save_embedding_layers=False)
            self.tokenizer.save_pretrained(tmp)
            replace_dir(tmp, self.out / "model")
        if dist.is_initialized():
            dist.barrier()


def _merged_lora_state(peft_model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The merged model's state dict from a PeftModel's consolidated (gathered) state dict:
    W + transpose(B @ A, fan_in_fan_out) * scaling per adapted linear layer, computed as peft's
    `lora.Linear.get_delta_weight` and `merge` do (fp32 for 16-bit weights, then W's dtype), and
    keys renamed to the base model's."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import transpose

    state = dict(state)
    for name, m in peft_model.named_modules():
        if not isinstance(m, LoraLayer):
            continue
        if not isinstance(m, LoraLinear) or any(m.use_dora.values()) or any(getattr(m, "lora_bias", {}).values()):
            raise ValueError(f"{name}: merging a {type(m).__name__} adapter from a ZeRO-3 state dict is not "
                             "supported; use train.<method>.export: adapter")
        for adapter in list(m.lora_A):
            a = state.pop(f"{name}.lora_A.{adapter}.weight")
            b = state.pop(f"{name}.lora_B.{adapter}.weight")
            w = f"{name}.base_layer.weight"
            fp32 = b.dtype in (torch.float16, torch.bfloat16)
            delta = transpose((b.float() if fp32 else b) @ (a.float() if fp32 else a), m.fan_in_fan_out) * m.scaling[adapter]
            state[w] = state[w] + delta.to(b.dtype)
    prefix = "base_model.model."
    return {k.removeprefix(prefix).replace(".base_layer.", "."): v for k, v in state.items()}


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


def _hidden_size(model_path: str) -> int | None:
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    return cfg.get("hidden_size") or cfg.get("text_config", {}).get("hidden_size")


def _float_or_none(x: Any) -> float | None:
    if x is None:
        return None
    return float(x.item() if hasattr(x, "item") else x)


def _log_line(row: dict[str, Any]) -> str:
    parts = [f"step {row['step']}: loss {row['loss']:.4f}"]
    if "rewards/accuracies" in row:
        parts.append(f"acc {row['rewards/accuracies']:.2f}, margin {row['rewards/margins']:.3f}")
    parts.append(f"{row['tokens_per_s'] / 1e3:.1f}k tok/s")
    parts.append(f"lr {row['lr']:.2e}")
    parts.append(f"peak {row['peak_allocated_bytes'] / 2**20:.1f} MiB")
    return ", ".join(parts)


# --------------------------------------------------------------------------- entry points
def _die_with_parent() -> None:
    """torchrun starts every rank in a session of its own: if torchrun is SIGKILLed the ranks would
    train on as orphans and race a resumed run for the checkpoint directory. PR_SET_PDEATHSIG makes
    the kernel SIGKILL this rank when its parent dies (prctl(2), Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1  # <linux/prctl.h>
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def run_rank(cfg: RunConfig) -> dict[str, Any]:
    _die_with_parent()
    if cfg.expandable_segments:
        # Read by the CUDA caching allocator at its first allocation, so set before any CUDA call.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if not cfg.probe_steps:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, _request_stop)
    _init_distributed()
    run = Run(cfg)
    try:
        run.setup()
        return run.fit()
    except torch.OutOfMemoryError as e:
        marker = Path(cfg.out_dir) / f"oom.rank{run.rank}.json"
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"rank": run.rank, "error": str(e)[:2000]}))
        raise SystemExit(OOM_EXIT_CODE) from e


def main(argv: list[str] | None = None) -> int:
    import warnings

    # torch.distributed deprecation notices that DeepSpeed triggers on every collective.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*|.*reduce_scatter_tensor.*")
    ap = argparse.ArgumentParser(prog="memfit train", description="Run one training rank (use `memfit launch` for all).")
    ap.add_argument("--config", required=True, help="run config JSON (RunConfig fields)")
    args = ap.parse_args(argv)
    cfg = RunConfig.load(args.config)
    summary = run_rank(cfg)
    if _rank() == 0:
        name = "probe.rank0.json" if cfg.probe_steps else "summary.json"
        write_json_atomic(Path(cfg.out_dir) / name, summary)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0
