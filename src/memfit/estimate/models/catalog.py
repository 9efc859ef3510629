"""What hardware and models exist: the GPU catalog and model architecture cards.

Data lives in `config/gpus.yaml` and `config/models.yaml` (each figure with its
source); this module loads it into frozen dataclasses and resolves user input:
a catalog name, a path to a HF `config.json`, or a model directory.

The model catalog stores the published `config.json` fields verbatim, so catalog
entries and user-supplied config files go through one parser (`arch_from_hf_config`).
Nothing here downloads anything: a HF hub id that is not a catalog name is an error.

    >>> from memfit.estimate.models import catalog
    >>> catalog.model("llama-2-7b").num_params()
    6738415616
    >>> catalog.gpu("a100-80gb").memory_gib
    80.0
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, dataclass, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from memfit.estimate.models.arch import ModelArch, UnsupportedArchitecture
from memfit.estimate.models.checkpoint_check import check_checkpoint
from memfit.estimate.models.hf_config import arch_from_hf_config
from memfit.units import GIB, MIB

# Repository-relative catalog files; overridable for tests via the `root` arguments.
REPO_ROOT = Path(__file__).resolve().parents[4]
GPUS_YAML = REPO_ROOT / "config" / "gpus.yaml"
MODELS_YAML = REPO_ROOT / "config" / "models.yaml"


@dataclass(frozen=True)
class GPU:
    """One accelerator kind (or `cpu`, the host). Bytes are what nvidia-smi reports as total."""

    name: str  # lowercase catalog name, e.g. "a100-80gb"
    memory_bytes: int  # device memory total as nvidia-smi reports it (MiB * 2**20)
    bf16: bool  # hardware bf16 support (Ampere and newer)
    flash_attn2: bool  # FlashAttention-2 supports this architecture (sm80+ ; not V100/T4)
    compute_capability: str  # e.g. "8.0"
    tflops_bf16: float  # peak dense bf16 tensor TFLOP/s (no sparsity); 0 when unsupported
    tflops_fp16: float  # peak dense fp16 tensor TFLOP/s (no sparsity)
    tflops_fp32: float  # peak fp32 TFLOP/s (non-tensor)
    memory_bandwidth_gbs: float  # device memory bandwidth, GB/s
    host_link_gbs: float  # host<->device bandwidth per direction, GB/s (PCIe gen x16)
    interconnect_gbs: float  # GPU<->GPU bandwidth per direction inside a node, GB/s (NVLink or PCIe)
    typical_gpus_per_node: int  # the common server/workstation configuration
    typical_host_memory_gb: float  # host RAM per node in that configuration (GB), default for --host-memory-gb
    source: str  # vendor spec URL(s) the figures come from
    interconnect_kind: str = "pcie"  # "nvlink", "pcie", "xgmi" (AMD Infinity Fabric), "host" (cpu)
    aliases: tuple[str, ...] = ()  # other lowercase names users type for this entry
    # True: figures for planning (estimate, fit) only; memfit has no tested path to train or
    # probe on this accelerator (e.g. AMD ROCm), and `planning_reason` says why.
    planning_only: bool = False
    planning_reason: str = ""

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB

    def tflops(self, precision: str) -> float:
        """Peak dense TFLOP/s for a training precision ("bf16", "fp16", "fp32")."""
        try:
            return {"bf16": self.tflops_bf16, "fp16": self.tflops_fp16, "fp32": self.tflops_fp32}[precision]
        except KeyError:
            raise ValueError(f"unknown precision {precision!r}: use bf16, fp16 or fp32") from None


# ----------------------------------------------------------------------------- GPUs


def _required(cls: type) -> list[str]:
    return [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]


@lru_cache(maxsize=8)
def _load_gpus_cached(path: Path) -> dict[str, GPU]:
    raw = _read_yaml(path)
    out: dict[str, GPU] = {}
    known = {f.name for f in fields(GPU)} | {"memory_mib"}
    for name, entry in raw.items():
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: entry {name!r} is not a mapping")
        unknown = set(entry) - known
        if unknown:
            raise ValueError(f"{path}: entry {name!r} has unknown fields {sorted(unknown)}")
        values = dict(entry)
        # The YAML holds the nvidia-smi figure in MiB; the dataclass holds bytes.
        if "memory_mib" in values:
            values["memory_bytes"] = int(values.pop("memory_mib")) * MIB
        values["name"] = name
        values["aliases"] = tuple(str(a).lower() for a in values.get("aliases", ()))
        missing = [f for f in _required(GPU) if f not in values]
        if missing:
            raise ValueError(f"{path}: GPU {name!r} is missing {missing}")
        values["compute_capability"] = str(values["compute_capability"])
        if values.get("planning_only") and not str(values.get("planning_reason", "")).strip():
            raise ValueError(f"{path}: GPU {name!r} is planning_only but has no planning_reason")
        out[name] = GPU(**values)
    return out


def load_gpus(path: Path = GPUS_YAML) -> dict[str, GPU]:
    """All GPU catalog entries by lowercase name (a fresh dict; the GPUs are frozen)."""
    return dict(_load_gpus_cached(Path(path)))


def gpu(name: str, path: Path = GPUS_YAML) -> GPU:
    """Look up a GPU by catalog name; unknown names raise ValueError listing the allowed ones."""
    gpus = _load_gpus_cached(Path(path))
    return _lookup(gpus, name, "GPU", path)


# ----------------------------------------------------------------------------- models


@dataclass(frozen=True)
class _Entry:
    """A model catalog entry's names, read without building its card."""

    name: str
    aliases: tuple[str, ...]
    hf_repo: str


class _Cards(Mapping[str, ModelArch]):
    """The model catalog by lowercase name, each card built at its first lookup: a card without a
    hand-written one builds its model on the meta device (memfit.estimate.models.generic), about 0.3 s
    each with an empty cache, so finding one model in a catalog of 15 such entries took 4.3 s
    when every card was built up front (2026-11-26, 2 cores). Names, aliases and hub ids are read
    from `entries` without building anything."""

    def __init__(self, path: Path, raw: dict[str, Any]) -> None:
        self.path, self.raw = path, raw
        self.entries: dict[str, _Entry] = {}
        for name, entry in raw.items():
            if not isinstance(entry, dict) or not isinstance(entry.get("config"), dict):
                raise ValueError(f"{path}: model {name!r} needs a `config:` mapping of config.json")
            aliases = tuple(str(a).lower() for a in entry.get("aliases", ()))
            self.entries[name] = _Entry(name, aliases, str(entry.get("hf_repo", "")))
        self._built: dict[str, ModelArch] = {}

    def __getitem__(self, name: str) -> ModelArch:
        if name not in self._built:
            entry = self.raw[name]
            arch = arch_from_hf_config(entry["config"], name=name, where=f"{self.path} [{name}]")
            self._built[name] = replace(
                arch,
                source=str(entry.get("source", "")),
                hf_repo=self.entries[name].hf_repo,
                aliases=self.entries[name].aliases,
            )
        return self._built[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)


@lru_cache(maxsize=8)
def _load_models_cached(path: Path) -> _Cards:
    return _Cards(path, _read_yaml(path))


def load_models(path: Path = MODELS_YAML) -> dict[str, ModelArch]:
    """All model cards by lowercase catalog name (a fresh dict; the cards are frozen)."""
    return dict(_load_models_cached(Path(path)))


def model(name_or_path: str | Path, path: Path = MODELS_YAML, *, allow_moe: bool = False) -> ModelArch:
    """A catalog name, a HF hub id of a catalog model, a path to a HF config.json, or a model
    directory containing one (its safetensors index or header is cross-checked, see
    `check_checkpoint`).

    Mixture-of-experts cards are returned only to callers that model experts (`allow_moe=True`:
    the estimator, `fit`, the workflow's config check, pipeline and report). Any other caller
    counts one dense MLP per layer, so for it an MoE model is refused with its real total and
    active parameter counts instead of being read as a dense model of a fraction of its size.
    """
    arch = _model(name_or_path, path)
    if arch.is_moe and not allow_moe:
        raise UnsupportedArchitecture(
            f"{arch.name}: mixture-of-experts model ({arch.model_type}: {arch.num_experts} routed "
            f"experts, {arch.num_experts_per_tok} per token; {arch.num_params():,} parameters in "
            f"total, {arch.num_active_params():,} active per token). This caller counts one dense "
            f"MLP per layer, so it refuses rather than reading a dense model of the wrong size "
            f"(memfit's estimator and workflow model the experts)"
        )
    return arch


def _model(name_or_path: str | Path, path: Path) -> ModelArch:
    text = str(name_or_path).strip()
    models = _load_models_cached(Path(path))
    # A bare catalog name wins over a same-named directory in the working directory; use
    # "./name" to force the path.
    looks_like_path = isinstance(name_or_path, Path) or "/" in text or "\\" in text
    if not looks_like_path and _resolve(models, text) is not None:
        return _lookup(models, text, "model", path)
    p = Path(text).expanduser()
    if p.is_dir():
        cfg = p / "config.json"
        if not cfg.is_file():
            raise ValueError(f"{p}: directory has no config.json")
        arch = model_from_config_file(cfg)
        check_checkpoint(arch, p)
        return arch
    if p.is_file():
        arch = model_from_config_file(p)
        if p.name == "config.json":  # a model directory's config: check it against its weights
            check_checkpoint(arch, p.parent)
        return arch
    card = hub_id_card(text, models)
    if card is not None:
        return card
    if looks_like_path or text.endswith(".json"):
        raise ValueError(
            f"{text!r}: no such file or directory, and not a catalog model. memfit never "
            f"downloads from the HF hub: pass a local model directory or its config.json, "
            f"or one of: {', '.join(sorted(models))}"
        )
    return _lookup(models, text, "model", path)


# Suffixes of chat/instruct/format variants whose weights have the base model's shapes.
_VARIANT_SUFFIXES = ("-instruct", "-chat", "-it", "-hf", "-base", "-pt")


def _strip_variant(repo_name: str) -> str:
    name = repo_name.lower()
    changed = True
    while changed:
        changed = False
        for suffix in _VARIANT_SUFFIXES:
            if name.endswith(suffix) and len(name) > len(suffix):
                name, changed = name[: -len(suffix)], True
    return name


def hub_id_card(hub_id: str, models: Mapping[str, ModelArch] | None = None) -> ModelArch | None:
    """The catalog card of a HF hub id ("Qwen/Qwen2.5-7B", "meta-llama/Llama-3.1-8B-Instruct"),
    case-insensitive, or None. -Instruct/-Chat/-it/-hf/-Base variants map to the card of the
    same architecture (their weights have the same shapes). Only ids under the organisation of
    a card's `hf_repo` match, so a third-party fine-tune is not silently taken for the original.
    """
    models = _load_models_cached(MODELS_YAML) if models is None else models
    org, sep, repo = hub_id.strip().lower().partition("/")
    if not sep or not org or not repo or "/" in repo:
        return None
    entries = _names(models)
    for key, entry in entries.items():
        if entry.hf_repo and entry.hf_repo.lower() == f"{org}/{repo}":
            return models[key]
    base = _strip_variant(repo)
    for key, entry in entries.items():
        card_org, _, card_repo = entry.hf_repo.lower().partition("/")
        if card_org != org:
            continue
        names = {_strip_variant(card_repo), entry.name, *entry.aliases}
        if base in names or repo in names or base in {_strip_variant(n) for n in names}:
            return models[key]
    return None


def model_from_config_file(config_json: str | Path) -> ModelArch:
    """Parse a HF config.json file (any supported style) into a ModelArch named by its path."""
    p = Path(config_json)
    try:
        cfg = json.loads(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from None
    except OSError as e:
        raise ValueError(f"{p}: cannot read ({e.strerror})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{p}: expected a JSON object")
    return arch_from_hf_config(cfg, name=str(p), where=str(p), source=str(p.resolve()))


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"catalog file not found: {path}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of name -> entry")
    return {str(k).lower(): v for k, v in data.items()}


def _names(catalog: Mapping[str, Any]) -> Mapping[str, Any]:
    """Each entry's names (`.name`, `.aliases`, `.hf_repo`), without building a model card."""
    return catalog.entries if isinstance(catalog, _Cards) else catalog


def _resolve(catalog: Mapping[str, Any], name: str) -> str | None:
    key = name.strip().lower()
    if key in catalog:
        return key
    for canonical, entry in _names(catalog).items():
        if key in entry.aliases:
            return canonical
    return None


def _lookup(catalog: Mapping[str, Any], name: str, what: str, path: Path) -> Any:
    key = _resolve(catalog, name)
    if key is not None:
        return catalog[key]
    allowed = sorted(catalog)
    candidates = allowed + [a for e in _names(catalog).values() for a in e.aliases]
    close = difflib.get_close_matches(name.strip().lower(), candidates, n=1, cutoff=0.5)
    hint = f" Did you mean {_resolve(catalog, close[0])!r}?" if close else ""
    raise ValueError(f"unknown {what} {name!r}.{hint} Allowed ({path.name}): {', '.join(allowed)}")
