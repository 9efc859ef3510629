"""What one training (or probe) run is asked to do: `RunConfig`, written as `run.json` by the
workflow and read by every rank, and the exit codes and marker a rank reports its end with."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.atomic import write_json_atomic

# what the trainer runs (memfit.train.losses: sft, dpo; memfit.train.preference: the others), and
# which of them hold a reference model (candidate.ref: model, adapter or precomputed)
from memfit.methods import METHODS, REFERENCE_METHODS, kernels_problems, speed_problems
from memfit.space import Candidate

OOM_EXIT_CODE = 3  # a rank that ran out of device memory exits with this after writing its marker
PREEMPTED_EXIT_CODE = 4  # checkpointed on SIGTERM/SIGUSR1; re-run to resume
PREEMPTED_MARKER = "preempted.json"  # written by rank 0 beside the checkpoints; the stopped ranks exit 1
REFUSED_EXIT_CODE = 2  # `memfit launch`: the ranks refused the run (RunRefused), as for any bad input

# The peak learning rate a run gets when its config gives none (`train.<method>.lr` omitted), per method
# and kind of fine-tuning: what practitioners' published recipes use for 7B-70B models.
# - full SFT 1e-5: LLaMA-Factory's examples/train_full/llama3_full_sft.yaml (learning_rate: 1.0e-5);
#   TRL's SFTConfig defaults to 2e-5 (trl/trainer/sft_config.py), the same order.
# - LoRA/QLoRA SFT 1e-4: the QLoRA paper (Dettmers et al. 2023, arXiv:2305.14314, Appendix B.2: 1e-4 for
#   33B and 65B, 2e-4 for 7B and 13B); LLaMA-Factory's examples/train_lora/llama3_lora_sft.yaml (1.0e-4).
# - full DPO 5e-7: the Zephyr-7B-beta recipe (huggingface/alignment-handbook,
#   recipes/zephyr-7b-beta/dpo/config_full.yaml: learning_rate 5.0e-7; Tunstall et al. 2023,
#   arXiv:2310.16944); TRL's DPOConfig defaults to 1e-6, the DPO paper (Rafailov et al. 2023) used 1e-6.
# - LoRA/QLoRA DPO 5e-6: the same recipe's adapter run (recipes/zephyr-7b-beta/dpo/config_qlora.yaml: 5.0e-6).
DEFAULT_LR = {
    ("sft", "full"): 1e-5,
    ("sft", "lora"): 1e-4,
    ("sft", "qlora"): 1e-4,
    ("dpo", "full"): 5e-7,
    ("dpo", "lora"): 5e-6,
    ("dpo", "qlora"): 5e-6,
    # The preference methods (values checked against TRL 1.16's config dataclasses):
    # - rm full 1e-5: Ouyang et al. 2022 (InstructGPT, arXiv:2203.02155, Appendix C.2: 9e-6 for the 6B
    #   reward model); LoRA/QLoRA 1e-4: TRL's RewardConfig default learning_rate (trl/trainer/reward_config.py).
    ("rm", "full"): 1e-5,
    ("rm", "lora"): 1e-4,
    ("rm", "qlora"): 1e-4,
    # - orpo, simpo, kto full 1e-6: TRL's ORPOConfig, CPOConfig (SimPO is CPO's loss_type "simpo") and
    #   KTOConfig defaults (trl/experimental/orpo/orpo_config.py, trl/experimental/cpo/cpo_config.py,
    #   trl/trainer/kto_config.py); SimPO's Llama-3-8B-Instruct recipe uses 1e-6 too (Meng et al. 2024,
    #   arXiv:2405.14734, Table 7). LoRA/QLoRA 1e-5: the factor 10 of the Zephyr DPO recipes above.
    ("orpo", "full"): 1e-6,
    ("orpo", "lora"): 1e-5,
    ("orpo", "qlora"): 1e-5,
    ("simpo", "full"): 1e-6,
    ("simpo", "lora"): 1e-5,
    ("simpo", "qlora"): 1e-5,
    ("kto", "full"): 1e-6,
    ("kto", "lora"): 1e-5,
    ("kto", "qlora"): 1e-5,
}


def default_lr(method: str, finetune: str) -> float:
    """The peak learning rate of a run whose config gives none (DEFAULT_LR, cited there)."""
    return DEFAULT_LR[(method, finetune)]


# The sane range of a configured peak learning rate: one order of magnitude either side of the
# default for its method and finetune. The sources cited at DEFAULT_LR spread by 2x at most around
# it (full SFT 1e-5 vs TRL's 2e-5, QLoRA 1e-4 vs 2e-4, full DPO 5e-7 vs TRL's and the DPO paper's
# 1e-6); 10x above is where the diverging runs lie (1e-3 full SFT; DPO at 1e-3 is 2,000x
# Zephyr's 5e-7), 10x below is a run that barely moves its weights.
LR_SANE_FACTOR = 10.0


def lr_range(method: str, finetune: str) -> tuple[float, float]:
    """(low, high): LR_SANE_FACTOR either side of default_lr(method, finetune)."""
    d = default_lr(method, finetune)
    return d / LR_SANE_FACTOR, d * LR_SANE_FACTOR


def lr_warning(method: str, finetune: str, lr: float) -> str | None:
    """One line when `lr` (train.<method>.lr) lies outside lr_range for its method and finetune,
    naming the key, the value and the range; None inside it. A warning, never an error: a tiny or
    randomly initialised model may need such a rate (`train.<method>.lr_check: false` silences it)."""
    low, high = lr_range(method, finetune)
    if low <= lr <= high:
        return None
    effect = "may diverge" if lr > high else "may barely move the weights"
    return (
        f"warning: train.{method}.lr {lr:g} is outside the usual range {low:g}..{high:g} for {finetune} "
        f"{method} (10x either side of memfit's cited default {default_lr(method, finetune):g}) and {effect}; "
        f"set train.{method}.lr_check: false if it is meant"
    )


class RunRefused(ValueError):
    """A clear refusal a rank raises (every rank alike): `memfit launch` prints its message once,
    without the ranks' tracebacks (memfit.train.rank_output), and exits with REFUSED_EXIT_CODE."""


@dataclass
class RunConfig:
    """Everything one training (or probe) run needs; written as `run.json` by the workflow."""

    method: str  # sft | dpo
    model_path: str  # HF model directory the policy starts from
    data_dir: str  # output of prepare_data: train.parquet, eval.parquet, stats.json
    out_dir: str  # run directory: metrics.jsonl, checkpoints/, model/
    candidate: dict[str, Any]  # a `Candidate` as a dict: ZeRO, offload, micro batch, seq_len ...
    # peak learning rate; None: default_lr(method, finetune), resolved in __post_init__ so that
    # run.json, run.resolved.json and the run's log say the number trained with
    lr: float | None = None
    lr_source: str = "config"  # "config": given by the user | "default": DEFAULT_LR for the method and finetune
    lr_check: bool = True  # False: no warning for a given lr outside lr_range (train.<method>.lr_check)
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
    # speed levers (docs/speed.md), off by default: regional torch.compile of the decoder layers
    # (memfit.train.compile); SFT micro batches as one row of concatenated rows (memfit.train.steps)
    compile: bool = False
    padding_free: bool = False
    # none | liger: Liger-Kernel's RMSNorm, RoPE, SwiGLU and fused linear cross-entropy (memfit.train.liger;
    # a CUDA GPU, or on the CPU Triton's interpreter, TRITON_INTERPRET=1, for tests)
    kernels: str = "none"
    lora_alpha: float | None = None  # default 2 * rank
    lora_dropout: float = 0.0
    lora_targets: str | list[str] = "all-linear"  # peft target_modules
    qlora_quant_type: str = "nf4"  # finetune qlora: 4-bit data type of the base weights, nf4 or fp4
    dpo: dict[str, Any] = field(default_factory=dict)  # DPOConfig fields: beta, loss_type, label_smoothing
    # rm, orpo, simpo, kto: their hyperparameters under TRL's names (memfit.train.preference.make_config)
    pref: dict[str, Any] = field(default_factory=dict)
    ref_model_path: str | None = None  # DPO reference (default: model_path, i.e. the SFT output)
    probe_steps: int = 0  # >0: probe mode: this many steps on the worst-case batch, no checkpoints
    expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (GPU only)
    deterministic: bool = False  # deterministic kernels (memfit.train.determinism): bitwise resumes on CUDA too
    loss_chunk_tokens: int | None = (
        None  # candidate.loss_impl chunked: tokens per chunk (None: 256 MiB of fp32 logits a chunk, vocab_loss.default_chunk_tokens)
    )
    mlp_tile_tokens: int | None = None  # candidate.tiled_mlp: tokens per sequence in a tile (None: hidden size)
    device_capacity_bytes: int | None = None  # without CUDA: live tensor bytes per rank above this raise OOM
    fallback: int = 0  # n > 0: the n-th OOM fallback (memfit.workflow.fallback): resumes checkpoints of earlier candidates that differ in levers only
    # SHA-256 of what the run starts from, {"model", "ref" (DPO), "data"} (memfit.train.identity): set
    # by the launcher in a copy of the run config; checkpoints and the DPO reference cache are tied to it
    inputs: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        d = json.loads(Path(path).read_text())
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{path}: unknown run config keys {unknown}")
        return cls(**d)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            allowed = ", ".join(repr(m) for m in METHODS)
            raise ValueError(
                f"invalid run config: method {self.method!r} is not one memfit trains (allowed: {allowed})"
            )
        problems = option_problems(self.method, self.loss_on, self.packing, self.export_format, [self.cand.finetune])
        if self.method in REFERENCE_METHODS and self.cand.ref is None:
            problems.append(
                f"{self.method} needs a reference mode (search.ref: model, adapter or precomputed); the candidate has none"
            )
        problems += preference_problems(self.method, self.pref, self.cand.micro_batch)
        problems += data_problems(self.method, self.data_dir)
        if self.cand.padding_free:  # the searched lever (search.padding_free) sets the trainer's
            self.padding_free = True
        if self.cand.compile:  # and search.compile the trainer's regional compile
            self.compile = True
        if self.cand.kernels != "none":  # and search.kernels the trainer's kernels
            self.kernels = self.cand.kernels
        problems += speed_problems(self.method, self.padding_free, self.cand.sequence_parallel)
        problems += kernels_problems(self.method, self.kernels)
        if problems:
            raise ValueError("invalid run config: " + "; ".join(problems))
        if self.lr is None:
            self.lr, self.lr_source = default_lr(self.method, self.cand.finetune), "default"

    def describe_lr(self) -> str:
        """One log line: the learning rate this run trains with and where it comes from."""
        if self.lr_source == "default":
            return (
                f"learning rate {self.lr:g} (memfit's default for {self.cand.finetune} {self.method}; "
                f"set train.{self.method}.lr to change it)"
            )
        line = f"learning rate {self.lr:g} (train.{self.method}.lr)"
        warning = lr_warning(self.method, self.cand.finetune, self.lr) if self.lr_check else None
        return f"{line}; {warning}" if warning else line

    def save(self, path: str | Path) -> None:
        write_json_atomic(Path(path), dataclasses.asdict(self))

    @property
    def cand(self) -> Candidate:
        return Candidate.from_dict(self.candidate)


def _data_kind(method: str) -> str:
    """What prepare_data writes for `method`: SFT rows, KTO's unpaired rows, or pairs (dpo, rm, orpo, simpo)."""
    return method if method in ("sft", "kto") else "pairs"


def data_problems(method: str, data_dir: str) -> list[str]:
    """Data prepared for a method whose rows `method` cannot read (its stats.json's `method`):
    SFT rows, pairs (dpo, rm, orpo and simpo read each other's) or KTO's unpaired rows. Nothing
    when stats.json is absent or names no method (the launcher's input checks report a missing one)."""
    try:
        prepared = json.loads((Path(data_dir) / "stats.json").read_text()).get("method")
    except (OSError, ValueError, AttributeError):
        return []
    if not isinstance(prepared, str) or _data_kind(prepared) == _data_kind(method):
        return []
    hint = " (kto takes pairs too: each becomes a desirable and an undesirable row)" if method == "kto" else ""
    return [
        f"data_dir {data_dir} was prepared for {prepared} (its stats.json), whose rows {method} cannot "
        f"train on; prepare the data with method {method}{hint}"
    ]


def preference_problems(method: str, values: dict[str, Any], micro_batch: int) -> list[str]:
    """What is wrong with the `pref` hyperparameters of rm, orpo, simpo or kto (each naming its key),
    and KTO's micro batch 1 (TRL's KTOTrainer refuses it: its KL batch is the batch's rotation)."""
    from memfit.train import preference

    out = []
    if method not in preference.METHODS:
        return [f"train.{method}: hyperparameters {sorted(values)} apply to rm, orpo, simpo, kto"] if values else []
    try:
        preference.make_config(method, values)
    except (ValueError, TypeError) as e:
        out.append(f"train.{method}: {e}")
    if method == "kto" and micro_batch < 2:
        out.append(
            "kto needs a micro batch of 2 or more (search.micro_batch; TRL's KTOTrainer refuses 1: "
            "the KL term's mismatched pairs come from the batch)"
        )
    return out


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
        out.append(
            f"{key}.packing: packing applies to sft only (a DPO pair is scored as one "
            "chosen/rejected forward); remove it or set it to false"
        )
    if export not in ("merged", "adapter"):
        out.append(f"{key}.export: {export!r} is not allowed (allowed: 'merged', 'adapter')")
    elif export == "adapter":
        full = sorted({f for f in finetunes if f not in ("lora", "qlora")})
        if full:
            out.append(
                f"{key}.export: 'adapter' needs finetune lora or qlora (search.finetune lists "
                f"{', '.join(full)}: a full fine-tune has no adapter); use export: merged"
            )
    return out
