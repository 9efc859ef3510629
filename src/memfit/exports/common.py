"""The skeleton every export shares: where the files go (`FILES`, `paths`), what an export is made
of (`ExportPlan`), the header each file starts with, and the optimizer and schedule fields the HF
Trainer and LLaMA-Factory both take (`hf_schedule`)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memfit.train.run_config import RunConfig

# the flag and argument names below are these releases' (pip install openrlhf==0.11.2 llamafactory==0.9.5)
OPENRLHF_VERSION = "0.11.2"
LLAMAFACTORY_VERSION = "0.9.5"

# Where each export lives, relative to the run directory (results/<model>/<gpu>/<method>).
FILES = {
    "openrlhf": "exports/openrlhf/train_{method}.sh",
    "llamafactory": "exports/llamafactory/train_{method}.yaml",
    "llamafactory_ds": "exports/llamafactory/ds_config.json",
    "llamafactory_dataset_info": "exports/llamafactory/dataset_info.json",
    "hf_args": "exports/hf/training_args.json",
    "hf_ds": "exports/hf/ds_config.json",
}

# What select_config writes instead of the exports when no candidate fits (a plan-only run).
NONE_FITS = "exports/NONE_FITS.txt"

# the role names memfit.data.chat reads (its ROLES: ShareGPT's human/gpt/system, OpenAI's); repeated
# here, as memfit.exports may not import memfit.data (tools/check_shape.py layers)
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant"}

# memfit's hyperparameters of rm, orpo, simpo and kto when `train.<method>` gives none: the defaults of
# memfit.train.preference's RMConfig, ORPOConfig, SimPOConfig and KTOConfig (TRL 1.16's names and
# defaults, but SimPO's cpo_alpha 0: TRL CPOConfig's 1.0 is CPO-SimPO). Repeated here, as memfit.exports
# may not import memfit.train.preference (tools/check_shape.py); tests/test_exports_pref.py holds them equal.
PREF_DEFAULTS: dict[str, dict[str, Any]] = {
    "rm": {"center_rewards_coefficient": None},
    "orpo": {"beta": 0.1},
    "simpo": {"beta": 0.1, "simpo_gamma": 0.5, "cpo_alpha": 0.0, "label_smoothing": 0.0},
    "kto": {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0},
}

ADAM_BETAS = (0.9, 0.95)  # memfit.train.dsconfig.build's AdamW defaults
ADAM_EPS = 1e-8


def paths(run_dir: str | Path, method: str) -> dict[str, Path]:
    """The export files of one run directory (the select_config outputs of workflow/rules/plan.smk)."""
    return {k: Path(run_dir) / v.format(method=method) for k, v in FILES.items()}


@dataclass(frozen=True)
class ExportPlan:
    """What every export is made of: the run, its DeepSpeed config and step schedule, the cluster."""

    run: RunConfig
    ds_config: dict[str, Any]  # memfit's ds_config.json
    num_gpus: int  # ranks per node
    num_nodes: int
    # optimizer steps (dsconfig.planned_steps); None: unknown (a plan without prepared data)
    total_steps: int | None
    warmup_steps: int | None
    data_source: str | None  # the raw dataset the workflow prepares (config data.<method>)
    eval_fraction: float = 0.0
    # SFT chat rows: loss on every assistant turn ("all") or the last only (config data.assistant_loss)
    assistant_loss: str = "all"
    # paths(): where each export is written, for the references between them
    files: dict[str, Path] = dataclasses.field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.num_gpus * self.num_nodes

    @property
    def global_batch(self) -> int:
        return self.run.cand.global_batch(self.world)  # a sequence-parallel group shares one batch

    @property
    def lora_alpha(self) -> float:
        # memfit.train.modeling's default: 2 x rank
        a = self.run.lora_alpha
        return a if a is not None else 2 * self.run.cand.lora_rank

    def file(self, key: str) -> str:
        return str(self.files.get(key, FILES[key].format(method=self.run.method)))


def pref_values(run: RunConfig) -> dict[str, Any]:
    """The run's rm/orpo/simpo/kto hyperparameters as it trains with them: `run.pref` over memfit's defaults."""
    return PREF_DEFAULTS[run.method] | dict(run.pref)


def targets(run: RunConfig) -> list[str]:
    t = run.lora_targets
    return [t] if isinstance(t, str) else list(t)


def int_alpha(plan: ExportPlan, tool: str, missing: list[str]) -> int:
    a = plan.lora_alpha
    if float(a) != int(a):
        missing.append(f"lora_alpha {a}: {tool} takes an integer alpha; {int(a)} written")
    return int(a)


@dataclass(frozen=True)
class SourceShape:
    """The raw dataset's row form, as memfit.data.chat reads it (docs/data.md), from its first row.

    form: "prompt" (prompt/response, prompt/chosen/rejected or KTO's prompt/completion/label
    strings), "chat" (an SFT conversation under `key`: `messages` or ShareGPT `conversations`),
    "chat_pairs" (conversational pairs: chosen/rejected turn lists, TRL's format, or single turn
    objects beside a `conversations` prompt, LLaMA-Factory's sharegpt ranking rows) or
    "chat_unpaired" (KTO rows whose prompt or completion are turns, TRL's conversational
    unpaired format)."""

    form: str = "prompt"
    key: str | None = None  # chat: the conversation's column; chat_pairs: the prompt's (None: implicit)
    sharegpt_turns: bool = False  # turns {from, value} with human/gpt/system, not {role, content}
    turn_objects: bool = False  # chosen/rejected (chat_unpaired: completion) one turn object each, not a list
    margin: bool = False  # pairs with a `margin` (rm: subtracted inside the sigmoid)
    unpaired: bool = False  # KTO's unpaired rows {prompt, completion, label}, not pairs


def _first_row(source: str | None) -> dict | None:
    """The first row of a .jsonl or .parquet dataset; None when there is none to read."""
    if not source:
        return None
    p = Path(source)
    try:
        if p.suffix == ".jsonl":
            with p.open() as f:
                for line in f:
                    if line.strip():
                        row = json.loads(line)
                        return row if isinstance(row, dict) else None
        elif p.suffix == ".parquet":
            import pyarrow.parquet as pq

            f = pq.ParquetFile(p)
            rows = f.read_row_group(0).slice(0, 1).to_pylist() if f.num_row_groups else []
            return rows[0] if rows else None
    except (OSError, ValueError):
        pass
    return None


def _sharegpt(turns: object) -> bool:
    first = turns[0] if isinstance(turns, list) and turns else turns
    # Arrow struct columns give every turn every field, the absent ones null (memfit.data.chat.turns)
    return isinstance(first, dict) and first.get("from") is not None and first.get("role") is None


def source_format(source: str | None) -> SourceShape:
    """The form of `source`'s rows (memfit.data.chat's precedence: `messages` over `conversations`
    over prompt/response; a pair is conversational when chosen/rejected are turns; a row with
    `completion` and `label` is KTO's unpaired row, memfit.data.unpaired.kto_rows)."""
    row = _first_row(source)
    if row is None:
        return SourceShape()
    if row.get("completion") is not None and row.get("label") is not None:  # memfit.data.unpaired.kto_rows
        prompt, completion = row.get("prompt"), row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return SourceShape(unpaired=True)
        turns = prompt if isinstance(prompt, (list, dict)) else completion
        return SourceShape("chat_unpaired", "prompt", _sharegpt(turns), isinstance(completion, dict), unpaired=True)
    chosen = row.get("chosen")
    if isinstance(chosen, (list, dict)):
        prompt = row.get("prompt")
        if isinstance(prompt, list):
            key = "prompt"
        elif row.get("conversations") is not None:
            key = "conversations"
        elif isinstance(prompt, str) and _first_role(chosen) == "assistant":
            key = "prompt"  # a string prompt beside assistant-only turns: the user turn
        else:
            key = None  # implicit: the shared prefix of chosen and rejected (a string prompt is ignored)
        turns = row[key] if key and isinstance(row[key], list) else chosen
        return SourceShape("chat_pairs", key, _sharegpt(turns), isinstance(chosen, dict), row.get("margin") is not None)
    key = next((k for k in ("messages", "conversations") if row.get(k) is not None), None)
    if key is None:
        return SourceShape(margin=row.get("margin") is not None)
    return SourceShape("chat", key, _sharegpt(row[key]))


def _first_role(turns: object) -> str | None:
    """The first turn's role, ShareGPT's names mapped (memfit.data.chat.ROLES)."""
    first = turns[0] if isinstance(turns, list) and turns else turns
    if not isinstance(first, dict):
        return None
    return ROLES.get(first.get("from") if _sharegpt(first) else first.get("role"))


def sharegpt_tags(shape: SourceShape) -> dict[str, str]:
    """LLaMA-Factory's sharegpt `tags` for the rows' turns (its data/README.md defaults for {from, value})."""
    if shape.sharegpt_turns:
        return {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                "system_tag": "system"}  # fmt: skip
    return {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
            "system_tag": "system"}  # fmt: skip


def header(plan: ExportPlan, tool: str, comment: str = "#") -> list[str]:
    run, c = plan.run, plan.run.cand
    steps = (
        f"{plan.total_steps} optimizer steps, {plan.warmup_steps} warmup"
        if plan.total_steps is not None
        else "step count unknown (no prepared data): the tool counts its own"
    )
    return [
        f"{comment} memfit's selected {run.method} configuration for {tool}, written by select_config.",
        f"{comment} candidate {c.id}; global batch {plan.global_batch} = micro {c.micro_batch} x accum {c.grad_accum} "
        f"x {c.data_parallel(plan.world)} data-parallel ranks"
        + (f" ({plan.world} ranks, {c.sequence_parallel} per sequence)" if c.sequence_parallel > 1 else "")
        + f"; {steps}.",
    ]


def hf_schedule(plan: ExportPlan, missing: list[str]) -> dict[str, Any]:
    """TrainingArguments fields of the optimizer and schedule (HF and LLaMA-Factory).

    The DeepSpeed JSON's WarmupCosineLR replaces the HF scheduler; the HF fields below describe
    the same curve (linear warmup from 0, cosine to min_lr_ratio x lr) for a run without it."""
    run = plan.run
    out: dict[str, Any] = {
        "learning_rate": run.lr,
        "weight_decay": run.weight_decay,
        "max_grad_norm": run.grad_clip,
        "adam_beta1": ADAM_BETAS[0],
        "adam_beta2": ADAM_BETAS[1],
        "adam_epsilon": ADAM_EPS,
        "lr_scheduler_type": "cosine_with_min_lr",
        "lr_scheduler_kwargs": {"min_lr_rate": run.min_lr_ratio},
        "seed": run.seed,
        "data_seed": run.seed,
        "logging_steps": run.log_every,
        "save_total_limit": run.keep_last,
    }
    if plan.total_steps is not None:
        # memfit's step count (epochs x rows // global batch): with it the JSON's total_num_steps and
        # the Trainer's num_training_steps agree; the tool counts its own rows only without it
        out |= {"max_steps": plan.total_steps, "warmup_steps": plan.warmup_steps}
    else:
        out |= {"num_train_epochs": run.epochs, "warmup_steps": run.warmup_steps}
    if run.save_every:
        out |= {"save_strategy": "steps", "save_steps": run.save_every}
    missing.append(
        "scheduler phase: memfit steps DeepSpeed's WarmupCosineLR once after initialize (step 1 at the "
        "schedule's step 1); the HF Trainer does not, so its lr runs one step behind memfit's"
    )
    return out


def not_expressible(missing: list[str], comment: str = "#") -> list[str]:
    """The lines listing the levers a tool cannot express (each file carries them)."""
    return [f"{comment}   - {m}" for m in missing] or [f"{comment}   (none)"]


def tiled_mlp_missing(c, tool: str, missing: list[str]) -> None:
    """The tiled MLP (DeepSpeed ALST's TiledMLP) has no setting in any exported trainer."""
    if c.tiled_mlp:
        missing.append(
            f"tiled_mlp: {tool} has no tiled-MLP setting (ArcticTraining's `tiled_mlp_compute: true` is one; "
            "without it the MLP's intermediates take more memory than memfit planned)"
        )
