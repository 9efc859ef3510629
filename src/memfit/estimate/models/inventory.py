"""Parameters read from transformers itself: the model a config.json describes, built with
`AutoModelForCausalLM.from_config` on the meta device (shapes and dtypes, no storage), and every
parameter's name, shape and module listed (`inventory`); the `ParamLayout` the estimator's ZeRO,
LoRA, QLoRA, DPO-reference and host terms use, computed from that list (`layout`); and the
parameters peft's LoRA adds, counted by applying peft to the same meta model (`lora_params`).

This is how memfit estimates an architecture it has no hand-written card for (any model_type in
transformers' causal-LM mapping, `ModelArch.hf_config` set): nothing about the weights is
modelled, so nothing can be missed. The hand-written cards (memfit.estimate.models.arch) stay for the
13 types they cover; tests/test_inventory.py holds the two equal.

Decoder layers are the `nn.ModuleList` with `num_hidden_layers` entries holding the most
parameters (every transformers decoder keeps its layers in one: `model.layers`, GPT-2's `h`,
Falcon's `h`, Mamba's `layers`); experts are the parameters under a module named `experts`
(transformers >= 5 fuses them into 3D parameters, `MixtralExperts`; older ports keep a
ModuleList of MLPs: both are found by the name). Imports torch and transformers lazily.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.estimate.errors import UnsupportedArchitecture

# Config fields naming the routed experts and the experts each token runs through, across
# transformers' MoE configs (MixtralConfig num_local_experts, Qwen2MoeConfig num_experts,
# DeepseekV3Config n_routed_experts, GptOssConfig num_local_experts, Llama4TextConfig
# num_local_experts, DbrxFFNConfig moe_num_experts, JambaConfig num_experts ...).
EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
TOP_K_FIELDS = (
    "num_experts_per_tok",
    "top_k_experts",
    "moe_top_k",
    "moe_k",
    "top_k",
    "moe_topk",
    "num_selected_experts",
)
INVENTORY_FORMAT = 2  # bump when what an inventory holds changes (old cache files are then ignored)
ENV_CACHE = "MEMFIT_TRACE_CACHE"  # the trace cache; inventories live in its `inventory` folder


@dataclass(frozen=True)
class Module:
    """One module that owns parameters (`recurse=False`): what ZeRO-3 gathers as one unit."""

    name: str  # qualified name in the model
    cls: str  # class name (Linear, Conv1D, LlamaRMSNorm, MixtralExperts ...)
    numels: tuple[int, ...]  # its own parameters, in registration order
    linear: tuple[int, int] | None  # (in, out) for nn.Linear / transformers Conv1D: LoRA targets
    layer: int | None  # decoder layer index, None outside the layers
    expert: bool  # under a module named `experts`


@dataclass(frozen=True)
class Inventory:
    """Every parameter-owning module of the model, in registration order, and what it is."""

    model_type: str
    class_name: str  # the transformers class AutoModelForCausalLM builds
    modules: tuple[Module, ...]
    num_layers: int
    total: int  # every parameter once (tied embeddings once)
    embed: int  # the input embedding (get_input_embeddings)
    lm_head: int  # the output embedding (get_output_embeddings); 0 when tied
    tied: bool
    buffers: int  # bytes of the buffers (rotary tables, router biases ...)
    num_experts: int  # routed experts per MoE layer (0: dense), from the config
    experts_per_token: int  # top-k (== num_experts when the config names none)
    # memfit's attention names (eager, sdpa, flash) the class implements (transformers'
    # PreTrainedModel `_supports_sdpa`, `_supports_flash_attn`): gpt-oss has no SDPA path,
    # Mamba and RWKV only their own kernels ("eager")
    attn: tuple[str, ...] = ("eager", "sdpa", "flash")

    def layer_modules(self, layer: int) -> tuple[Module, ...]:
        return tuple(m for m in self.modules if m.layer == layer)

    def layer_kinds(self, types: list[Any] | None = None) -> list[list[int]]:
        """The decoder layers grouped by kind, in order of first appearance: layers whose
        parameter-owning modules (class and sizes) differ, and, given `types` (a config's
        layer_types), whose entries there differ."""
        kinds: dict[tuple[Any, ...], list[int]] = {}
        for i in range(self.num_layers):
            modules = tuple((m.cls, m.numels) for m in self.layer_modules(i))
            kinds.setdefault((types[i] if types else None, modules), []).append(i)
        return list(kinds.values())

    def layer_numel(self, layer: int) -> int:
        return sum(sum(m.numels) for m in self.layer_modules(layer))

    @property
    def expert_numel(self) -> int:
        return sum(sum(m.numels) for m in self.modules if m.expert)

    @property
    def inactive(self) -> int:
        """Parameters of the routed experts a token skips: (E - k) / E of every expert."""
        if not self.num_experts:
            return 0
        return self.expert_numel * (self.num_experts - self.experts_per_token) // self.num_experts


def config_from_dict(cfg: dict[str, Any], where: str = "config.json") -> Any:
    """A transformers PretrainedConfig from a parsed config.json (`AutoConfig.for_model`)."""
    from transformers import AutoConfig

    fields = dict(cfg)
    model_type = str(fields.pop("model_type", "") or "")
    if not model_type:
        raise UnsupportedArchitecture(
            f"{where}: config.json has no 'model_type': transformers cannot tell which model it is"
        )
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as exc:  # noqa: BLE001 - the config class's own validation, named below
        raise UnsupportedArchitecture(
            f"{where}: transformers cannot read this config (model_type {model_type!r}): {exc}"
        ) from None


def with_layers(config: Any, num_layers: int, kinds: tuple[Any, ...] | None = None) -> Any:
    """A copy of `config` with `num_layers` decoder layers: num_hidden_layers set and every
    per-layer list (a list with one entry per layer: layer_types, no_rope_layers, ...) cut to
    its first `num_layers` entries, or, with `kinds`, `layer_types` set to them."""

    layers = int(config.num_hidden_layers)
    out = copy.deepcopy(config)
    for key, value in list(vars(out).items()):
        if isinstance(value, list) and len(value) == layers and layers != num_layers:
            setattr(out, key, value[:num_layers])
    out.num_hidden_layers = num_layers
    if isinstance(getattr(out, "decoder_layers", None), int):
        out.decoder_layers = num_layers  # BART-style configs: num_hidden_layers names the encoder
    if kinds is not None:
        out.layer_types = list(kinds)
    return out


def build_meta(config: Any, where: str = "config.json") -> Any:
    """`AutoModelForCausalLM.from_config(config)` on the meta device: shapes, no storage."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises is the refusal's reason
        raise UnsupportedArchitecture(
            f"{where}: transformers {transformers_version()} cannot build model_type {config.model_type!r} with "
            f"AutoModelForCausalLM: {type(exc).__name__}: {str(exc)[:300]}"
        ) from None


def wrapper_params(config: Any, where: str = "config.json") -> int:
    """Parameters of a whole multimodal checkpoint (vision tower, projector and text model): the
    class transformers builds for it as image-text-to-text, else as a causal LM, else its base
    model (AutoModel), on the meta device. Image-text-to-text first: for Qwen3.5 and Llama-4,
    AutoModelForCausalLM builds the text model alone."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

    for auto in (AutoModelForImageTextToText, AutoModelForCausalLM, AutoModel):
        try:
            with torch.device("meta"):
                model = auto.from_config(config)
        except (ValueError, KeyError):
            continue
        return int(sum(p.numel() for p in model.parameters()))
    raise UnsupportedArchitecture(f"{where}: transformers builds no model of this {config.model_type} checkpoint")


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def decoder_layers(model: Any, num_layers: int) -> tuple[str, Any]:
    """(qualified name, ModuleList) of the decoder layers: the ModuleList of num_hidden_layers
    entries holding the most parameters, else (a config whose num_hidden_layers names another
    stack: BigBird-Pegasus' encoder) the ModuleList holding the most parameters."""
    import torch

    best: tuple[bool, int, str, Any] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > 0:
            rank = (len(mod) == num_layers, sum(p.numel() for p in mod.parameters()), name, mod)
            if best is None or rank[:2] > best[:2]:
                best = rank
    if best is None:
        return "", None
    return best[2], best[3]


def _linear_shape(mod: Any) -> tuple[int, int] | None:
    """(in, out) of the modules peft's "all-linear" adapts: nn.Linear and transformers' Conv1D
    (peft/tuners/tuners_utils.py `_maybe_include_all_linear_layers`: `(nn.Linear, Conv1D)`)."""
    import torch

    if isinstance(mod, torch.nn.Linear):
        return (mod.in_features, mod.out_features)
    if type(mod).__name__ == "Conv1D" and hasattr(mod, "nf"):  # transformers.pytorch_utils.Conv1D: weight (in, out)
        return (int(mod.weight.shape[0]), int(mod.nf))
    return None


def _int_field(config: Any, names: tuple[str, ...]) -> int:
    for n in names:
        v = getattr(config, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return 0


def inventory_of(model: Any, config: Any) -> Inventory:
    """The inventory of a built (meta) model."""
    num_layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    layers_name, layers = decoder_layers(model, num_layers)
    num_layers = len(layers) if layers is not None else 0
    prefix = f"{layers_name}." if layers_name else None
    seen: set[int] = set()
    modules = []
    for name, mod in model.named_modules():
        own = [p for p in mod.parameters(recurse=False) if id(p) not in seen]
        if not own:
            continue
        seen.update(id(p) for p in own)
        layer = None
        if prefix and name.startswith(prefix):
            layer = int(name[len(prefix) :].split(".", 1)[0])
        parts = name.split(".")
        modules.append(
            Module(
                name=name,
                cls=type(mod).__name__,
                numels=tuple(int(p.numel()) for p in own),
                linear=_linear_shape(mod),
                layer=layer,
                expert="experts" in parts[:-1] or parts[-1] == "experts",
            )
        )
    emb = model.get_input_embeddings()
    out = model.get_output_embeddings()
    embed = int(emb.weight.numel()) if emb is not None else 0
    tied = out is not None and emb is not None and out.weight is emb.weight
    lm_head = int(out.weight.numel()) if (out is not None and not tied) else 0
    experts = _int_field(config, EXPERT_FIELDS)
    top_k = _int_field(config, TOP_K_FIELDS) or experts
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return Inventory(
        model_type=str(config.model_type),
        class_name=type(model).__name__,
        modules=tuple(modules),
        num_layers=num_layers if layers is not None else 0,
        total=sum(sum(m.numels) for m in modules),
        embed=embed,
        lm_head=lm_head,
        tied=tied,
        buffers=int(buffers),
        num_experts=experts if any(m.expert for m in modules) else 0,
        experts_per_token=min(top_k, experts) if experts else 0,
        attn=tuple(
            a
            for a, flag in (("eager", True), ("sdpa", "_supports_sdpa"), ("flash", "_supports_flash_attn"))
            if flag is True or getattr(type(model), flag, False) is True
        ),
    )


def cache_root() -> Path:
    """The trace cache ($MEMFIT_TRACE_CACHE, else ~/.cache/memfit/traces)."""
    env = os.environ.get(ENV_CACHE)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "memfit" / "traces"


def _versions() -> str:
    from importlib.metadata import version  # no torch import for a cache hit

    return ",".join(f"{p}={version(p)}" for p in ("torch", "transformers", "peft"))


def _from_json(d: dict[str, Any]) -> Inventory:
    mods = tuple(
        Module(**{**m, "numels": tuple(m["numels"]), "linear": tuple(m["linear"]) if m["linear"] else None})
        for m in d["modules"]
    )
    return Inventory(**{**d, "modules": mods, "attn": tuple(d["attn"])})


def cached(kind: str, text: str, compute: Any) -> Any:
    """`compute()`'s JSON answer for `text` (a canonical config), cached in
    `cache_root()/inventory` under a hash of the text and the torch, transformers and peft
    versions; written atomically (temporary file + os.replace). A read-only or broken cache
    costs the recomputation, nothing else."""
    key = hashlib.sha256(f"{INVENTORY_FORMAT}|{_versions()}|{kind}|{text}".encode()).hexdigest()[:24]
    path = cache_root() / "inventory" / f"{kind}-{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    value = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(value))
        os.replace(tmp, path)
    except OSError:
        pass
    return value


@functools.lru_cache(maxsize=64)
def inventory(config_json: str, where: str = "config.json") -> Inventory:
    """The inventory of the causal LM a config.json (as canonical JSON, hashable) describes;
    cached (`cached`): building a 671B model on the meta device takes about a second and
    imports its modeling code, reading the file milliseconds."""

    def build() -> dict[str, Any]:
        config = config_from_dict(json.loads(config_json), where)
        inv = inventory_of(build_meta(config, where), config)
        if inv.num_layers == 0:
            raise UnsupportedArchitecture(
                f"{where}: {inv.class_name} has no list of {getattr(config, 'num_hidden_layers', '?')} "
                f"decoder layers (num_hidden_layers) memfit can find"
            )
        return dataclasses.asdict(inv)

    d = cached("inventory", config_json, build)
    try:
        return _from_json(d)
    except (TypeError, KeyError):  # a file from another layout of the same format: rebuild
        return _from_json(build())
