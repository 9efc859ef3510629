"""The published GPU training throughput as data: the schema of a row and a sweep of
`tests/public_throughput.yaml` (`REQUIRED`, `OPTIONAL`, the published metrics and the allowed
values), `Row` (one timed run as an estimator call) and `Sweep` (rows a source varied one lever
over), `load_table`, which checks every row and sweep (`TableError` names the row or sweep and
the key), and the sources' own MFU definitions (`MFU_DEFINITIONS`). memfit_validation.step_time
compares the estimator against it. A row memfit cannot represent is `not_comparable`, with the
reason: never approximated.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from memfit.estimate import EstimateError, Settings, estimate
from memfit.estimate.models import catalog
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.models.hf_config import arch_from_hf_config
from memfit.space import Candidate

if TYPE_CHECKING:
    from memfit.estimate import Estimate

REPO_ROOT = Path(__file__).resolve().parents[2]
TABLE = REPO_ROOT / "tests" / "public_throughput.yaml"

# A row's keys, its `published` figures and choices, as the table's header comment defines them (offload:
# DeepSpeed's offload_optimizer / offload_param; FSDP FULL_SHARD and FSDP2 are `zero: 3`, `sharding: fsdp`)
REQUIRED = (
    "id", "source", "quote", "framework", "model", "gpu", "num_gpus", "num_nodes", "finetune",
    "precision", "zero", "sharding", "seq_len", "micro_batch", "global_batch", "grad_accum",
    "grad_ckpt", "attn", "offload", "compile", "published", "sweep", "notes",
)  # fmt: skip
OPTIONAL = (
    "model_config", "gpu_mismatch", "interconnect", "precision_printed", "inferred", "lora_rank",
    "lora_alpha", "lora_dropout", "lora_targets",
)  # fmt: skip
PUBLISHED = ("tokens_per_s_per_gpu", "mfu_pct", "hfu_pct", "tflops_per_gpu", "seconds_per_step", "throughput_unitless")
# The absolute figures compared, in this order of preference; True: a rate (higher is faster).
COMPARED = ("tokens_per_s_per_gpu", "seconds_per_step")
METRIC_IS_RATE = {"tokens_per_s_per_gpu": True, "throughput_unitless": True, "seconds_per_step": False}
OFFLOAD = {"none": ("none", "none"), "optimizer": ("cpu", "none"), "optimizer+param": ("cpu", "cpu")}
SHARDING = {"none": (0, 1, 2), "deepspeed": (0, 1, 2, 3), "fsdp": (3,)}
CHOICES = (("precision", ("bf16", "fp16", "fp32", "fp8", None)), ("finetune", ("full", "lora", "qlora")),
           ("grad_ckpt", (True, False, "selective", None)))  # fmt: skip
# a sweep's `ties` differ by less than this (the header of public_throughput.yaml: "< 1% (or are equal)")
TIE_SHARE = 0.01
# The table's attention kernels -> memfit's, and what is assumed (costs._compute_seconds prices only eager
# apart); triton: llm-foundry's Triton FlashAttention "also never materialises the s x s scores" (header)
ATTN = {
    "flash": ("flash", ""), "sdpa": ("sdpa", ""), "eager": ("eager", ""),
    "triton": ("flash", "attn triton (llm-foundry's Triton FlashAttention) priced as flash: a fused kernel"),
    None: ("sdpa", "attention kernel not stated: a fused kernel (sdpa) assumed"),
}  # fmt: skip
# Qwen-7B (v1) linears (modeling_qwen.py: QWenAttention.c_attn fused q/k/v with bias, c_proj; QWenMLP
# c_proj(w1(x) * silu(w2(x)))) -> their ModelArch names (qwen2 with fused_qkv)
QWEN1_LORA_NAMES = {
    "c_attn": ("qkv_proj",), "c_proj": ("o_proj", "down_proj"), "w1": ("up_proj",), "w2": ("gate_proj",),
}  # fmt: skip
MPT_REASON = (
    "MPT: a learned position table (max_seq_len x d_model: 8,388,608 of the printed NumParams at seq 2048, "
    "268,435,456 at 65536) and LayerNorm biases, which ModelArch cannot hold; hf_config refuses model_type 'mpt'"
)


def _torchtitan_flops_per_token(arch: ModelArch, seq_len: int) -> float:
    """torchtitan's `get_num_flop_per_token` (torchtitan/utils.py): 6 * num_params + 12 * l * h *
    q * t (l layers, h heads, q = dim // heads, t = seq_len), num_params with the embeddings: this
    reproduces the Llama 2 13B rows' printed MFU from their WPS (61.1%; without them 60.4%)."""
    q = arch.hidden_size // arch.num_attention_heads
    return 6 * arch.num_params() + 12 * arch.num_layers * arch.num_attention_heads * q * seq_len


# The sources' MFU definitions (framework prefix -> flops per token, peak FLOP/s by GPU). torchtitan's
# get_peak_flops (torchtitan/utils.py): A100 312e12 (nvidia.com/en-us/data-center/a100, bf16 dense), H100
# SXM 989e12. Other frameworks' MFU definitions are not implemented: their MFU is not compared.
MFU_DEFINITIONS = {"torchtitan": (_torchtitan_flops_per_token, {"a100-80gb": 312e12, "h100-80gb": 989e12})}


class TableError(ValueError):
    """A row or sweep of the throughput table is incomplete or inconsistent (names it and the key)."""


@dataclass(frozen=True)
class Row:
    id: str
    raw: Mapping[str, Any]
    framework: str
    gpu: str
    num_gpus: int  # all nodes
    num_nodes: int
    global_batch: int
    seq_len: int
    published: Mapping[str, float]
    sweeps: tuple[str, ...]
    arch: ModelArch | None = None
    cand: Candidate | None = None
    settings: Settings = Settings()
    assumptions: tuple[str, ...] = ()  # how the row was mapped where the table leaves it open
    not_comparable: str = ""  # why memfit cannot predict this row ("": it can)

    @property
    def unit(self) -> str:
        """The published unit compared absolutely ("": order only)."""
        return "" if self.raw.get("gpu_mismatch") else next((u for u in COMPARED if u in self.published), "")

    @property
    def order_only(self) -> str:
        """Why no absolute figure is compared ("" when one is)."""
        gm = self.raw.get("gpu_mismatch")
        return (
            f"not the catalog {self.gpu}: {gm}"
            if gm
            else ""
            if self.unit
            else "only a unitless throughput is published"
        )


@dataclass(frozen=True)
class Sweep:
    name: str
    lever: str
    metric: str  # a key of METRIC_IS_RATE
    order: tuple[str, ...]  # fastest first
    ties: tuple[frozenset[str], ...]
    caveat: str = ""


def load_table(path: Path = TABLE) -> tuple[tuple[Row, ...], tuple[Sweep, ...]]:
    """(rows, sweeps) of the table, each checked."""
    with open(path) as f:
        doc = yaml.safe_load(f)
    if not isinstance(doc, Mapping) or not isinstance(doc.get("rows"), list):
        raise TableError(f"{path}: expected a mapping with a list `rows:`")
    rows = tuple(parse_row(d, f"{path} rows[{i}]") for i, d in enumerate(doc["rows"]))
    ids = [r.id for r in rows]
    if len(set(ids)) != len(ids):
        raise TableError(f"{path}: duplicate row ids {sorted({i for i in ids if ids.count(i) > 1})}")
    sweeps = tuple(parse_sweep(name, s, rows, path) for name, s in (doc.get("sweeps") or {}).items())
    stray = sorted({(r.id, name) for r in rows for name in r.sweeps} - {(i, s.name) for s in sweeps for i in s.order})
    if stray:
        raise TableError(f"{path}: (row, sweep) {stray}: the sweep is not under `sweeps:`")
    return rows, sweeps


def parse_row(d: Any, where: str) -> Row:
    """One YAML row as a `Row`; TableError names the row and the key."""
    if not isinstance(d, Mapping):
        raise TableError(f"{where}: a row must be a mapping, got {d!r}")
    rid = d.get("id", "?")
    _check_keys(d, where, rid)
    try:
        gpu = catalog.gpu(str(d["gpu"]))
    except (ValueError, KeyError) as exc:
        raise TableError(f"{where}: row {rid!r}: gpu: {exc}") from None
    sweeps = d["sweep"] or ()
    row = Row(
        id=str(rid), raw=dict(d), framework=str(d["framework"]), gpu=gpu.name, num_gpus=d["num_gpus"],
        num_nodes=d["num_nodes"], global_batch=d["global_batch"], seq_len=d["seq_len"],
        published={k: float(v) for k, v in d["published"].items()},
        sweeps=(sweeps,) if isinstance(sweeps, str) else tuple(sweeps),
    )  # fmt: skip
    arch, why = _arch(d, where, rid)
    if arch is None:
        return dataclasses.replace(row, not_comparable=why)
    cand, settings, notes, why = _candidate(d, arch, where, rid)
    if cand is None:
        return dataclasses.replace(row, arch=arch, not_comparable=why)
    notes += ["torch.compile on: not modelled"] if d.get("compile") else []
    row = dataclasses.replace(row, arch=arch, cand=cand, settings=settings, assumptions=tuple(notes))
    try:  # the row must map to a valid estimator call
        e = predict(row)
    except EstimateError as exc:
        raise TableError(f"{where}: row {rid!r}: {exc}") from None
    return dataclasses.replace(row, not_comparable=f"the estimator calls it invalid: {e.reason}") if e.invalid else row


def _check_keys(d: Mapping[str, Any], where: str, rid: Any) -> None:
    def fail(what: str) -> None:
        raise TableError(f"{where}: row {rid!r}: {what}")

    missing, unknown = [k for k in REQUIRED if k not in d], sorted(set(d) - set(REQUIRED) - set(OPTIONAL))
    if missing or unknown:
        fail(f"lacks {missing}" if missing else f"has unknown keys {unknown}")
    problems = [f"{k} is empty" for k in ("source", "quote", "framework", "model") if not str(d[k] or "").strip()]
    problems += [
        f"{k} must be a positive integer, got {d[k]!r}"
        for k in ("num_gpus", "num_nodes", "seq_len", "micro_batch", "global_batch", "grad_accum")
        if isinstance(d[k], bool) or not isinstance(d[k], int) or d[k] < 1
    ]
    problems += [
        f"{k} must be one of {list(allowed)}, got {d[k]!r}"
        for k, allowed in (("offload", OFFLOAD), ("sharding", SHARDING), ("attn", ATTN), *CHOICES)
        if d[k] not in allowed
    ]
    if problems:
        fail("; ".join(problems))
    pub, sweep = d["published"], d["sweep"]
    if not isinstance(pub, Mapping) or not pub or set(pub) - set(PUBLISHED):
        fail(f"published must map some of {list(PUBLISHED)} to figures, got {pub!r}")
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 for v in pub.values()):
        fail(f"every published figure must be a positive number, got {dict(pub)!r}")
    if d["zero"] not in SHARDING[d["sharding"]]:
        fail(f"zero {d['zero']!r} does not go with sharding {d['sharding']!r}")
    if d["num_gpus"] % d["num_nodes"]:
        fail(f"num_gpus {d['num_gpus']} is not a multiple of num_nodes {d['num_nodes']}")
    if d["global_batch"] != d["micro_batch"] * d["grad_accum"] * d["num_gpus"]:
        fail(f"global_batch {d['global_batch']} != micro_batch x grad_accum x num_gpus")
    if not (sweep is None or isinstance(sweep, str) or (isinstance(sweep, list) and sweep)):
        fail(f"sweep must be null, a name or a list of names, got {sweep!r}")


def _arch(d: Mapping[str, Any], where: str, rid: Any) -> tuple[ModelArch | None, str]:
    """(the row's ModelArch, "") or (None, why it cannot be represented faithfully)."""
    cfg = d.get("model_config")
    if cfg is None:
        try:
            return catalog.model(str(d["model"])), ""
        except ValueError as exc:
            raise TableError(f"{where}: row {rid!r}: model: {exc}") from None
    if not isinstance(cfg, Mapping):
        raise TableError(f"{where}: row {rid!r}: model_config must be a mapping, got {cfg!r}")
    if "d_model" in cfg and "expansion_ratio" in cfg:
        return None, MPT_REASON
    # rotary positions hold no weights and no FLOPs: max_position_embeddings is only fit()'s upper
    # bound (validity.SIZE_FIELDS), so the row's own length stands in where the table has none
    hf = {"max_position_embeddings": int(cfg.get("max_position_embeddings", d["seq_len"]))}
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")
    try:
        hf.update({k: int(cfg[k]) for k in keys}, tie_word_embeddings=bool(cfg["tie_word_embeddings"]))
        if cfg.get("architecture") == "QWenLMHeadModel":
            return _qwen1_arch(cfg, hf, str(d["model"]))
        if cfg.get("mlp") == "SwiGLU":
            # Llama 2 (torchtitan's llama2 model): RMSNorm, rotary, SwiGLU, no biases = HF llama
            hf.update(model_type="llama", intermediate_size=int(cfg["intermediate_size"]))
            return arch_from_hf_config(hf, str(d["model"])), ""
    except KeyError as exc:
        raise TableError(f"{where}: row {rid!r}: model_config lacks {exc}") from None
    raise TableError(
        f"{where}: row {rid!r}: model_config is none of the shapes memfit reads (MPT: d_model/"
        f"expansion_ratio; architecture QWenLMHeadModel; mlp SwiGLU), got {sorted(cfg)}"
    )


def _qwen1_arch(cfg: Mapping[str, Any], hf: dict[str, Any], name: str) -> tuple[ModelArch | None, str]:
    """Qwen-7B (v1) as memfit's qwen2 card with a fused q/k/v: the same modules (Qwen's
    tech_memo.md: RMSNorm, SwiGLU, rotary, untied embeddings, "no biases except for QKV"; c_attn
    one Linear(h, 3h) with bias, as Qwen2's q/k/v biases with `fused_qkv`; each MLP branch
    intermediate_size // 2 wide, as QWenMLP builds w1 and w2)."""
    branch = int(cfg["mlp_branch_width"])
    if branch != int(cfg["intermediate_size"]) // 2:
        return None, f"Qwen-7B (v1): mlp_branch_width {branch} != intermediate_size // 2 (QWenMLP)"
    if not cfg.get("qkv_bias"):
        return None, "Qwen-7B (v1) without qkv_bias: memfit's qwen2 card always has q/k/v biases"
    arch = arch_from_hf_config({**hf, "model_type": "qwen2", "intermediate_size": branch}, name)
    return dataclasses.replace(arch, fused_qkv=True), ""


def _candidate(
    d: Mapping[str, Any], arch: ModelArch, where: str, rid: Any
) -> tuple[Candidate | None, Settings, list[str], str]:
    """(the row's levers as a Candidate, its Settings, the assumptions made, "") or (None, ...,
    why it cannot be represented)."""
    notes: list[str] = []
    precision = d["precision"]
    if precision == "fp8":
        return None, Settings(), notes, "fp8: memfit models bf16/fp16/fp32 only"
    if precision is None:
        gpu, precision = catalog.gpu(str(d["gpu"])), "bf16"
        same = " (fp16 has the same catalog peak)" if gpu.tflops_bf16 == gpu.tflops_fp16 else ""
        notes.append(f"precision not printed: bf16 assumed{same}")
    ckpt = d["grad_ckpt"]
    if ckpt is None:
        return None, Settings(), notes, "gradient checkpointing not stated"
    if ckpt == "selective":
        notes.append("selective AC priced as memfit's only one: every layer recomputed (one more forward)")
    attn, said = ATTN[d["attn"]]
    notes += [said] if said else []
    finetune, rank, targets = d["finetune"], Candidate.lora_rank, None
    if finetune != "full":
        rank, t = d.get("lora_rank"), d.get("lora_targets")
        if not isinstance(rank, int) or t is None:
            raise TableError(f"{where}: row {rid!r}: a {finetune} row needs lora_rank and lora_targets")
        if isinstance(t, list) and arch.fused_qkv:  # Qwen-7B (v1) names
            targets = tuple(sorted({n for x in t for n in QWEN1_LORA_NAMES.get(x, (x,))}))
        elif isinstance(t, list):
            targets = tuple(str(x) for x in t)
        elif t != "all-linear":
            raise TableError(f"{where}: row {rid!r}: lora_targets must be all-linear or a list, got {t!r}")
    oo, op = OFFLOAD[d["offload"]]
    try:
        cand = Candidate(
            zero=int(d["zero"]), offload_optimizer=oo, offload_param=op, grad_ckpt=bool(ckpt), attn=attn,
            finetune=finetune, lora_rank=rank, micro_batch=int(d["micro_batch"]), seq_len=int(d["seq_len"]),
            grad_accum=int(d["grad_accum"]), precision=precision,
        )  # fmt: skip
    except ValueError as exc:
        raise TableError(f"{where}: row {rid!r}: {exc}") from None
    internode, said = _internode_gbs(d)
    notes += [said] if said else []
    # every row trains full-length samples (the table's header): fixed shapes, variable_length False
    settings = Settings(
        lora_targets=targets, lora_alpha_dropout=bool(d.get("lora_dropout")), variable_length=False, padding_mask=False,
        zero3_impl="fsdp" if d["sharding"] == "fsdp" else "deepspeed", internode_gbs=internode,
        zero0_engine="deepspeed" if "DeepSpeed" in str(d["framework"]) else "torch",
    )  # fmt: skip
    return cand, settings, notes, ""


def _internode_gbs(d: Mapping[str, Any]) -> tuple[float, str]:
    """Per-GPU inter-node bandwidth (GB/s) from the row's `interconnect` ("N GB/s per GPU", or
    "N Gbps node-node" shared by the node's GPUs), else memfit's default (Settings.internode_gbs)."""
    default = Settings().internode_gbs
    if d["num_nodes"] == 1:
        return default, ""
    text = str(d.get("interconnect") or "")
    if m := re.search(r"(\d+(?:\.\d+)?) GB/s per GPU", text):
        return float(m.group(1)), ""
    if m := re.search(r"(\d+(?:\.\d+)?) Gbps node-node", text):  # bits -> bytes, shared by the node's GPUs
        return float(m.group(1)) / 8 / (d["num_gpus"] // d["num_nodes"]), ""
    return default, f"inter-node network not stated: memfit's default {default:g} GB/s per GPU"


def parse_sweep(name: str, s: Any, rows: Iterable[Row], path: Path) -> Sweep:
    """One `sweeps:` entry, checked: its rows exist and name it, and `published_order` (fastest
    first) agrees with their printed figures, equal or < 1% apart only where `ties` says so."""

    def fail(what: str) -> None:
        raise TableError(f"{path}: sweep {name!r}: {what}")

    if not isinstance(s, Mapping) or not all(k in s for k in ("lever", "metric", "published_order")):
        fail("needs lever, metric and published_order")
    metric, by_id = str(s["metric"]).split()[0], {r.id: r for r in rows}
    if metric not in METRIC_IS_RATE:
        fail(f"metric must start with one of {list(METRIC_IS_RATE)}, got {s['metric']!r}")
    order = tuple(str(i) for i in s["published_order"])
    ties = tuple(frozenset(str(i) for i in t) for t in (s.get("ties") or []))
    for rid in order:
        if rid not in by_id or metric not in by_id[rid].published:
            fail(f"published_order names {rid!r}, which is not a row with published {metric}")
    members = sorted(r.id for r in rows if name in r.sweeps)
    if members != sorted(order):
        fail(f"the rows naming it {members} are not those of published_order {sorted(order)}")
    if any(len(t) < 2 or not t <= set(order) for t in ties):
        fail(f"every ties entry must name two or more rows of published_order, got {s['ties']}")
    sweep = Sweep(name, str(s["lever"]), metric, order, ties, str(s.get("caveat") or ""))
    for a, b in itertools.combinations(order, 2):
        fa, fb = by_id[a].published[metric], by_id[b].published[metric]
        if published_tie(sweep, a, b) and abs(fa - fb) >= TIE_SHARE * max(fa, fb):
            fail(f"ties {a!r} and {b!r} differ by {TIE_SHARE:.0%} or more ({fa} vs {fb})")
        if (fa < fb if METRIC_IS_RATE[metric] else fa > fb) or (fa == fb and not published_tie(sweep, a, b)):
            fail(f"published_order puts {a!r} ({fa}) before {b!r} ({fb})")
    return sweep


def published_tie(sweep: Sweep, a: str, b: str) -> bool:
    return any({a, b} <= t for t in sweep.ties)


def predict(row: Row) -> Estimate:
    """The estimate of the row's run (sft; per-node GPUs = num_gpus / num_nodes)."""
    if row.cand is None or row.arch is None:
        raise TableError(f"row {row.id!r} is not comparable: {row.not_comparable}")
    per_node, gpu = row.num_gpus // row.num_nodes, catalog.gpu(row.gpu)
    return estimate(row.arch, gpu, per_node, row.num_nodes, "sft", row.cand, settings=row.settings)
