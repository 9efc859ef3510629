"""The public measurements as data: the schema of a row of `tests/public_measurements.yaml`
(`REQUIRED`, `OPTIONAL` and the allowed values of each key), `Row` (one measured run as an
estimator call) and `parse_row`, which checks a YAML row and builds it (TableError names the row
and the key). memfit_validation.memory loads the table with it and compares the estimator against it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.estimate import EstimateError, Settings, estimate
from memfit.estimate.models import catalog
from memfit.space import Candidate
from memfit.units import GIB, MIB

REPO_ROOT = Path(__file__).resolve().parents[2]
TABLE = REPO_ROOT / "tests" / "public_measurements.yaml"
FIXTURE_MODELS = REPO_ROOT / "tests" / "fixtures" / "public_models"

REQUIRED = (
    "id",
    "source",
    "quote",
    "framework",
    "model",
    "gpu",
    "num_gpus",
    "finetune",
    "lora_rank",
    "lora_targets",
    "lora_dropout",
    "precision",
    "zero",
    "offload",
    "seq_len",
    "micro_batch",
    "grad_accum",
    "grad_ckpt",
    "attn",
    "measured",
    "loss_impl",
    "published",
    "notes",
)
OPTIONAL = (
    "unit_note",
    "explained",
    "device_memory",
    "published_rounding",
    "bound",
    "zero_buckets",
)
# Where a DeepSpeed run's bucket sizes came from: the HF Trainer's "auto" (h*h, memfit's own
# dsconfig.bucket_sizes) or DeepSpeed's defaults (no JSON file: accelerate's DeepSpeedPlugin
# writes no bucket keys, and only keys set to "auto" are filled in).
ZERO_BUCKETS = ("hf-auto", "deepspeed-defaults")
BOUNDS = ("upper",)
MEASURED = ("allocated", "reserved", "nvidia-smi", "max-fit")
# The estimator figure each kind of measurement is compared with.
FIGURE = {
    "allocated": "peak_allocated_bytes",
    "reserved": "peak_reserved_bytes",
    "nvidia-smi": "device_total_bytes",
    "max-fit": "device_total_bytes",
}
UNITS = {"GB": 10**9, "GiB": GIB, "MiB": MIB}
AMBIGUOUS_GB = "GB-or-GiB"  # a "GB" the source leaves open: compared as [value GB, value GiB]
LOSS_IMPL = ("hf-model-fp32", "hf-loss-function", "torchtune-held")
OFFLOAD = {
    "none": ("none", "none"),
    "optimizer": ("cpu", "none"),
    "optimizer+param": ("cpu", "cpu"),
}


class TableError(ValueError):
    """A row of the measurement table is incomplete or does not map to an estimator call."""


@dataclass(frozen=True)
class Row:
    id: str
    raw: Mapping[str, Any]
    model: str
    gpu: str
    num_gpus: int
    cand: Candidate
    settings: Settings
    measured: str
    published_bytes: int
    explained: str = ""
    budget_bytes: int | None = None  # device memory of a max-fit/oom row when not the GPU's own
    # the interval the measurement lies in (published_rounding, bound: upper); None: the point
    published_range: tuple[int, int] | None = None

    @property
    def figure(self) -> str:
        return FIGURE[self.measured]


def model_card(name: str):
    """The row's model: a fixture config.json under tests/fixtures/public_models, else the catalog's."""
    fixture = FIXTURE_MODELS / f"{name}.json"
    if fixture.exists():
        return catalog.model_from_config_file(fixture)
    return catalog.model(name)


# Keys whose value must be one of a fixed set: (key, allowed values as the error shows them,
# default when the key is optional and absent).
CHOICES = (
    ("measured", MEASURED, None),
    ("zero_buckets", ZERO_BUCKETS, "hf-auto"),
    ("loss_impl", LOSS_IMPL, None),
    ("offload", sorted(OFFLOAD), None),
)


def parse_row(d: Mapping[str, Any], where: str) -> Row:
    """One YAML row as a `Row`, every field checked; TableError names the row and the key."""
    rid = d.get("id", "?")
    _check_keys(d, where, rid)
    try:
        arch = model_card(str(d["model"]))
        gpu = catalog.gpu(str(d["gpu"]))
    except (ValueError, KeyError, FileNotFoundError) as exc:
        raise TableError(f"{where}: row {rid!r}: {exc}") from None
    budget = _device_budget(d, where, rid)
    published, published_range = _published(d, gpu, budget, where, rid)
    cand, targets = _candidate(d, where, rid)
    settings = _settings(d, targets)
    row = Row(
        id=str(rid),
        raw=dict(d),
        model=str(d["model"]),
        gpu=gpu.name,
        num_gpus=int(d["num_gpus"]),
        cand=cand,
        settings=settings,
        measured=d["measured"],
        published_bytes=published,
        explained=str(d.get("explained", "") or ""),
        budget_bytes=budget,
        published_range=published_range,
    )
    # the row must map to a valid estimator call (targets that exist, hardware that can run it)
    try:
        e = estimate(arch, gpu, row.num_gpus, 1, "sft", cand, budget_bytes=budget, settings=settings)
    except EstimateError as exc:
        raise TableError(f"{where}: row {rid!r}: {exc}") from None
    if e.invalid:
        raise TableError(f"{where}: row {rid!r}: the estimator calls it invalid: {e.reason}")
    return row


def _check_keys(d: Mapping[str, Any], where: str, rid: Any) -> None:
    missing = [k for k in REQUIRED if k not in d]
    if missing:
        raise TableError(f"{where}: row {rid!r} lacks {missing}")
    unknown = sorted(set(d) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise TableError(f"{where}: row {rid!r} has unknown keys {unknown}")
    for k in ("source", "quote", "framework"):
        if not str(d[k]).strip():
            raise TableError(f"{where}: row {rid!r}: {k} is empty")
    for key, allowed, default in CHOICES:
        value = d.get(key, default)
        if value not in allowed:
            raise TableError(f"{where}: row {rid!r}: {key} must be one of {allowed}, got {d[key]!r}")


def _device_budget(d: Mapping[str, Any], where: str, rid: Any) -> int | None:
    """The device memory of a row measured below the GPU's own (device_memory), else None."""
    if "device_memory" not in d:
        return None
    dm = d["device_memory"]
    if not isinstance(dm, Mapping) or dm.get("unit") not in UNITS or "unit_note" not in d:
        raise TableError(
            f"{where}: row {rid!r}: device_memory must be {{value, unit}} with unit in "
            f"{sorted(UNITS)} and a unit_note, got {dm!r}"
        )
    return int(float(dm["value"]) * UNITS[dm["unit"]])


def _published(
    d: Mapping[str, Any], gpu: Any, budget: int | None, where: str, rid: Any
) -> tuple[int, tuple[int, int] | None]:
    """(the published figure in bytes, the interval the measurement lies in or None)."""
    pub = d["published"]
    if not isinstance(pub, Mapping) or set(pub) != {"value", "unit"}:
        raise TableError(f"{where}: row {rid!r}: published must be {{value, unit}}, got {pub!r}")
    if d["measured"] == "max-fit" or pub["unit"] == "device":
        if not (d["measured"] == "max-fit" or rid.endswith("-oom")) or pub["unit"] != "device":
            raise TableError(f"{where}: row {rid!r}: unit 'device' goes with measured max-fit (or an oom row)")
        published = budget if budget is not None else gpu.memory_bytes
    elif pub["unit"] == AMBIGUOUS_GB:
        # "GB" printed by a source that does not say whether it means 1e9 or 2**30 bytes: the
        # measurement lies between the two readings; the point is the larger (GiB) reading
        if "unit_note" not in d or d.get("published_rounding") is not None or "bound" in d:
            raise TableError(
                f"{where}: row {rid!r}: unit {AMBIGUOUS_GB} takes a unit_note saying why the "
                "unit is open, and no published_rounding or bound"
            )
        published = int(float(pub["value"]) * GIB)
    else:
        if pub["unit"] not in UNITS:
            raise TableError(
                f"{where}: row {rid!r}: unit must be one of {sorted(UNITS)}, {AMBIGUOUS_GB} or "
                f"device, got {pub['unit']!r}"
            )
        if pub["unit"] == "GB" or pub["unit"] == "GiB":
            if "unit_note" not in d:
                raise TableError(f"{where}: row {rid!r}: say why the figure is {pub['unit']} (unit_note)")
        published = int(float(pub["value"]) * UNITS[pub["unit"]])
    published_range = None
    if pub["unit"] == AMBIGUOUS_GB:
        published_range = (int(float(pub["value"]) * 10**9), published)
    if d.get("published_rounding") is not None:  # null: a merged row drops its anchor's
        r = d["published_rounding"]
        if (
            pub["unit"] not in UNITS
            or isinstance(r, bool)
            or not isinstance(r, (int, float))
            or not 0 < r <= float(pub["value"])
        ):
            raise TableError(
                f"{where}: row {rid!r}: published_rounding must be a positive number in the "
                f"published unit (GB, GiB or MiB), at most the value; got {r!r} {pub['unit']}"
            )
        if "unit_note" not in d:
            raise TableError(
                f"{where}: row {rid!r}: say how the figure was rounded (unit_note) with published_rounding"
            )
        half = float(r) / 2 * UNITS[pub["unit"]]
        published_range = (int(published - half), int(published + half))
    if "bound" in d:
        if d["bound"] not in BOUNDS:
            raise TableError(f"{where}: row {rid!r}: bound must be one of {BOUNDS}, got {d['bound']!r}")
        if published_range is not None:
            raise TableError(f"{where}: row {rid!r}: bound and published_rounding exclude each other")
        published_range = (0, published)
    if d["measured"] == "max-fit" and d.get("bound") != "upper":
        raise TableError(
            f"{where}: row {rid!r}: a max-fit figure (the device's memory) only bounds the run's "
            "peak from above: say `bound: upper`"
        )
    return published, published_range


def _candidate(d: Mapping[str, Any], where: str, rid: Any) -> tuple[Candidate, tuple[str, ...] | None]:
    """(the row's levers as a Candidate, its LoRA targets: None for all linear layers)."""
    oo, op = OFFLOAD[d["offload"]]
    finetune = d["finetune"]
    if finetune == "full":
        if d["lora_rank"] is not None or d["lora_targets"] is not None:
            raise TableError(f"{where}: row {rid!r}: full fine-tuning takes lora_rank/lora_targets null")
        rank, targets = Candidate.lora_rank, None
    else:
        rank = int(d["lora_rank"])
        t = d["lora_targets"]
        if t == "all-linear":
            targets = None
        elif isinstance(t, list) and t:
            targets = tuple(str(x) for x in t)
        else:
            raise TableError(f"{where}: row {rid!r}: lora_targets must be all-linear or a list, got {t!r}")
    try:
        cand = Candidate(
            zero=int(d["zero"]),
            offload_optimizer=oo,
            offload_param=op,
            grad_ckpt=bool(d["grad_ckpt"]),
            attn=d["attn"],
            finetune=finetune,
            lora_rank=rank,
            micro_batch=int(d["micro_batch"]),
            seq_len=int(d["seq_len"]),
            grad_accum=int(d["grad_accum"]),
            precision=d["precision"],
            ref="precomputed" if finetune == "full" else "adapter",
        )
    except ValueError as exc:
        raise TableError(f"{where}: row {rid!r}: {exc}") from None
    return cand, targets


def _settings(d: Mapping[str, Any], targets: tuple[str, ...] | None) -> Settings:
    """The estimator settings that describe the row's trainer."""
    return dataclasses.replace(
        Settings(),
        lora_targets=targets,
        lora_alpha_dropout=bool(d["lora_dropout"]),
        # every row's batches are packed or padded to seq_len (see the rows' notes): one shape
        # every step, the estimator's fixed-shape fragmentation share
        variable_length=False,
        # priced without a padded batch's attention-mask term (padding_mask._padding_mask_extra):
        # most rows run FlashAttention-2, which the term does not touch; the table's values were
        # settled before the term was found, and which of its sdpa rows carried a mask is not published
        padding_mask=False,
        # the row's trainer's logits handling (the YAML's loss_impl names the same cases as
        # memfit.estimate's Settings.logits_handling)
        logits_handling=d["loss_impl"],
        scaled_buckets=d.get("zero_buckets", "hf-auto") == "hf-auto",
        # a stage-3 row whose framework names FSDP is FSDP FULL_SHARD, not DeepSpeed's runtime
        zero3_impl="fsdp" if "FSDP" in str(d["framework"]) else "deepspeed",
        # QLoRA rows train under HF Trainer/peft, which keep what prepare_model_for_kbit_training
        # upcast to fp32; only a DeepSpeed engine casts it back (states._resident_weight_bytes)
        qlora_fp32_upcast="DeepSpeed" not in str(d["framework"]),
        # a stage-0 row of a trainer without DeepSpeed steps a torch optimizer on the parameters'
        # own gradients (no engine all-reduce copy, no FP16_Optimizer)
        zero0_engine="deepspeed" if "DeepSpeed" in str(d["framework"]) else "torch",
    )
