"""The workflow config (config/config.yaml, or `--configfile`): validated once, then typed.

`WorkflowConfig.load(raw)` checks the schema (workflow/schemas/config.schema.yaml) and what
a schema cannot know (catalog names, files, method sections, the global batch) and raises
`ConfigError` naming every offending key. Snakemake does this once, when the Snakefile is
read (workflow/rules/common.smk); the stages wrap the already validated dict with
`WorkflowConfig.of`. Everything that derives a value from config keys lives here: the world
size, a GPU's memory budget, the sequence length, the search space of a method, a run's
`RunConfig` and where a model's weights and a run's policy come from.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit.estimate import catalog
from memfit.space import Candidate, enumerate_space
from memfit.units import GIB, MIB
from memfit.workflow.rows import Budget, derived_budget

if TYPE_CHECKING:
    from memfit.train.run_config import RunConfig

SCHEMA = Path(__file__).resolve().parents[3] / "workflow" / "schemas" / "config.schema.yaml"
AUTO = "auto"  # headroom auto or absent: the derived margin (memfit.workflow.rows.derived_budget)
RESULTS = "results"  # every output of the workflow lives under this directory


class ConfigError(ValueError):
    """A workflow config that cannot run; the message names every offending key."""


@dataclass(frozen=True)
class ModelEntry:
    """One `models.<name>` entry: where its weights are, or how to build them, or its architecture."""

    name: str
    path: str | None  # HF model directory (weights and tokenizer)
    build: str | None  # HF config.json the demo builds `path` from
    arch: str | None  # catalog name or config.json, for plan-only runs without weights


@dataclass(frozen=True)
class ProbeSettings:
    """`probe:`: how many candidates to measure, for how many optimizer steps, for how long at most."""

    top_k: int
    steps: int
    timeout_s: float
    # One probe more for the fastest candidate predicted over the budget by at most this fraction
    # (a "boundary probe": measures the estimator where it decides); 0: none. See README.
    boundary_margin: float = 0.20
    # measure this machine's step times before estimating (the calibrate rule); never with plan_only
    calibrate: bool = True


@dataclass(frozen=True)
class WorkflowConfig:
    """The validated workflow config. `raw` is the dict Snakemake holds (numbers coerced)."""

    raw: Mapping[str, Any]

    # -- reading ---------------------------------------------------------------------------
    @classmethod
    def load(cls, raw: dict[str, Any], schema_path: Path = SCHEMA) -> WorkflowConfig:
        """Validate `raw` (coercing numbers written as strings, in place) and wrap it."""
        validate_config(raw, schema_path)
        return cls(raw)

    @classmethod
    def from_file(cls, path: str | Path, schema_path: Path = SCHEMA) -> WorkflowConfig:
        """Read a YAML config file and validate it; a syntax error names the line and column."""
        return cls.load(load_yaml(path), schema_path)

    @classmethod
    def of(cls, config: WorkflowConfig | Mapping[str, Any]) -> WorkflowConfig:
        """`config` as a WorkflowConfig: a stage's `snakemake.config` was validated when the
        Snakefile was read, so it is wrapped, not validated again."""
        return config if isinstance(config, WorkflowConfig) else cls(config)

    # -- the cluster ------------------------------------------------------------------------
    @property
    def models(self) -> list[str]:
        return list(self.raw["models"])

    @property
    def gpus(self) -> list[str]:
        return list(self.raw["gpus"])

    @property
    def methods(self) -> list[str]:
        return list(self.raw["methods"])

    @property
    def plan_only(self) -> bool:
        return bool(self.raw.get("plan_only", False))

    @property
    def num_gpus(self) -> int:
        """Ranks per node: GPUs per node, or processes on `cpu`."""
        return int(self.raw["num_gpus"])

    @property
    def num_nodes(self) -> int:
        return int(self.raw.get("num_nodes", 1))

    @property
    def world_size(self) -> int:
        return self.num_gpus * self.num_nodes

    def budget(self, gpu_name: str) -> Budget:
        """Device memory of one rank, host RAM of one node, and the headroom selection keeps free."""
        gpu = catalog.gpu(gpu_name)
        if gpu.name == "cpu":
            device = int(float(self.raw["cpu_memory_mib"]) * MIB)
        else:
            device = gpu.memory_bytes
        host = int(float(self.raw.get("host_memory_gib") or gpu.typical_host_memory_gb * 1e9 / GIB) * GIB)
        if self.raw.get("headroom", AUTO) == AUTO:  # the margin memfit's measured error calls for (issue #42)
            return derived_budget(device, host, gpu.name, gpu.compute_capability)
        return Budget(device_bytes=device, host_bytes=host, headroom=float(self.raw["headroom"]))

    @property
    def slurm(self) -> dict[str, Any]:
        """`slurm:` (partition, account, cpus_per_gpu, runtime_min, gpu_types), {} when absent;
        memfit.workflow.slurm.rule_resources turns it into each job's resources."""
        return dict(self.raw.get("slurm") or {})

    @property
    def probe(self) -> ProbeSettings:
        p = self.raw["probe"]
        return ProbeSettings(
            top_k=int(p["top_k"]),
            steps=int(p["steps"]),
            timeout_s=float(p.get("timeout_s", 900)),
            boundary_margin=float(p.get("boundary_margin", 0.20)),
            calibrate=bool(p.get("calibrate", True)),
        )

    def calibration_inputs(self, model: str, gpu: str) -> list[str]:
        """The step-time calibration estimate_candidates reads: this machine's, measured where the
        probes run; none for a plan (plan_only: the GPUs are not here) or with probe.calibrate false."""
        if self.plan_only or not self.probe.calibrate:
            return []
        return [f"results/{model}/{gpu}/calibration.json"]

    @property
    def estimate(self) -> dict[str, Any]:
        """`estimate:` (activations: analytic | traced, trace_cache), {} when absent."""
        return dict(self.raw.get("estimate") or {})

    # -- the search space ------------------------------------------------------------------
    @property
    def seq_len(self) -> int:
        return int(self.raw["search"].get("seq_len") or self.raw["data"]["max_len"])

    def candidates(self, method: str) -> list[Candidate]:
        """The configured search space, grad_accum set so every candidate trains the same global batch."""
        axes = {k: v for k, v in self.raw["search"].items() if k != "seq_len"}
        fixed: dict[str, Any] = {"seq_len": self.seq_len}
        if method != "dpo":
            axes.pop("ref", None)
            fixed["ref"] = None  # no reference model: SFT ids carry no ref-<mode> (memfit.space.Candidate.id)
        world = self.world_size
        global_batch = int(self.raw["train"]["global_batch"])
        out = []
        packing = bool((self.raw["train"].get(method) or {}).get("packing", False))
        for cand in enumerate_space(axes, fixed=fixed):
            if world % cand.sequence_parallel:
                continue  # a sequence-parallel group must fit the ranks evenly
            if packing and cand.sequence_parallel > 1 and cand.attn != "flash":
                continue  # packed rows under Ulysses need flash (memfit.train.sequence_parallel.PACKING_NEEDS_FLASH)
            per_step = cand.micro_batch * cand.data_parallel(world)
            if global_batch % per_step:
                continue  # this micro batch cannot make the global batch on this many ranks
            out.append(dataclasses.replace(cand, grad_accum=global_batch // per_step))
        if not out:
            raise ValueError(
                f"train.global_batch={global_batch} is not a multiple of micro_batch x ranks for any "
                f"micro_batch in {self.raw['search'].get('micro_batch')} with {world} ranks"
            )
        return out

    # -- one run ---------------------------------------------------------------------------
    def run_config(self, method: str, cand: dict[str, Any], model_path: str, data_dir: str, out_dir: str) -> RunConfig:
        """The `RunConfig` of one candidate: the config's `train` section plus the method's."""
        from memfit.train.run_config import RunConfig

        train = self.raw["train"]
        per_method = dict(train[method])
        dpo = {k: per_method.pop(k) for k in ("beta", "loss_type", "label_smoothing") if k in per_method}
        if "export" in per_method:  # train.<method>.export: merged | adapter
            per_method["export_format"] = per_method.pop("export")
        common = {
            k: train[k]
            for k in (
                "seed",
                "save_every",
                "keep_last",
                "eval_every",
                "log_every",
                "loss_chunk_tokens",
                "mlp_tile_tokens",
                "deterministic",
            )
            if k in train
        }
        return RunConfig(
            method=method,
            model_path=model_path,
            data_dir=data_dir,
            out_dir=out_dir,
            candidate=cand,
            dpo=dpo,
            ref_model_path=model_path if method == "dpo" else None,
            **common,
            **per_method,
        )

    # -- where things are: the one home of model paths and the results layout ---------------
    def model(self, name: str) -> ModelEntry:
        m = self.raw["models"][name]
        return ModelEntry(name=name, path=m.get("path"), build=m.get("build"), arch=m.get("arch"))

    def model_path(self, name: str) -> str | None:
        """The model's weights directory (built by build_demo_model when the entry has `build`)."""
        return self.model(name).path

    def built_models(self) -> list[str]:
        """Models the workflow builds (`build:`); every other `path:` must already exist."""
        return [name for name in self.models if self.model(name).build is not None]

    def model_inputs(self, name: str) -> list[str]:
        """The weights directory a job waits for; none for a plan-only model that is not built."""
        m = self.model(name)
        return [] if self.plan_only and not m.build else [m.path]

    def will_have_weights(self, name: str) -> bool:
        """The weights exist, or the workflow builds them."""
        m = self.model(name)
        return bool(m.path) and (Path(m.path).exists() or m.build is not None)

    def arch_source(self, name: str) -> str:
        """Where the architecture comes from: the model directory if it has a config.json, else
        the entry's `arch` (a catalog name or config.json), else the model's name in the catalog."""
        m = self.model(name)
        if m.path and (Path(m.path) / "config.json").exists():
            return m.path
        return m.arch or name

    def run_dir(self, model: str, gpu: str, method: str) -> str:
        return f"{RESULTS}/{model}/{gpu}/{method}"

    def policy_path(self, model: str, gpu: str, method: str) -> str | None:
        """What training starts from: the SFT output for DPO when the workflow trains SFT, else the base model."""
        if method == "dpo" and "sft" in self.methods:
            return f"{self.run_dir(model, gpu, 'sft')}/train/model"
        return self.model_path(model)

    def policy_inputs(self, model: str, gpu: str, method: str) -> list[str]:
        if method == "dpo" and "sft" in self.methods:
            # the SFT run's summary is written after its model export (merged or adapter only)
            return [f"{self.run_dir(model, gpu, 'sft')}/train/summary.json"]
        return self.model_inputs(model)


# --------------------------------------------------------------------------- validation
def load_yaml(path: str | Path) -> dict[str, Any]:
    """The YAML mapping in `path`; ConfigError naming the file, line and column otherwise."""
    import yaml

    p = Path(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such config file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not UTF-8 text") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{p}: YAML syntax error{where}: {what}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a YAML mapping of config keys, got {type(data).__name__}")
    return data


def validate_config(config: dict[str, Any], schema_path: Path = SCHEMA) -> None:
    """Schema check plus what a schema cannot know (catalog names, files, method sections).

    Coerces numbers written as strings in place. Raises ConfigError listing each problem as
    `key.path: what is wrong (allowed: ...)`, before any job starts.
    """
    import jsonschema
    import yaml

    schema = yaml.safe_load(Path(schema_path).read_text())
    _coerce_numbers(config, schema, schema)
    problems = []
    for err in sorted(jsonschema.Draft7Validator(schema).iter_errors(config), key=lambda e: list(e.path)):
        where = ".".join(str(p) for p in err.path) or "(top level)"
        msg = err.message
        if err.validator == "enum":
            msg = f"{err.instance!r} is not allowed (allowed: {', '.join(map(repr, err.validator_value))})"
        elif err.validator == "additionalProperties":
            allowed = sorted(err.schema.get("properties", {}))
            msg = f"{msg} (allowed keys: {', '.join(allowed)})" if allowed else msg
        problems.append(f"{where}: {msg}")
    if not problems:
        problems += _detect_gpus(config)
    if not problems:
        problems += _semantic_problems(WorkflowConfig(config))
    if problems:
        raise ConfigError("invalid memfit config:\n  " + "\n  ".join(problems))
    from memfit.workflow.search_checks import search_warnings

    for warning in search_warnings(WorkflowConfig(config)):
        print(f"memfit: warning: {warning}", file=sys.stderr)


def _detect_gpus(config: dict[str, Any]) -> list[str]:
    """`gpus: [detect]` becomes the catalog name of this machine's GPU (nvidia-smi), in place, so
    that the {gpu} wildcard and every stage see the name."""
    from memfit.estimate.detect import DETECT, DetectError, detect_gpu

    for i, name in enumerate(config["gpus"]):
        if name == DETECT:
            try:
                config["gpus"][i] = detect_gpu()
            except DetectError as e:
                return [f"gpus[{i}]: {e} (on the command line: --config 'gpus=[h100-80gb]')"]
    return []


def _coerce_numbers(value: Any, node: dict[str, Any], root: dict[str, Any]) -> Any:
    """Numbers written as strings where the schema wants a number: YAML 1.1 reads `1e-5` (no dot)
    as a string, and `snakemake --config 'train={...}'` passes nested values as strings."""
    if "$ref" in node:
        node = root["definitions"][node["$ref"].rsplit("/", 1)[-1]]
    types = node.get("type", [])
    types = [types] if isinstance(types, str) else types
    if isinstance(value, str) and {"number", "integer"} & set(types):
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if "integer" in types and number.is_integer() else number
    if isinstance(value, dict):
        extra = node.get("additionalProperties")
        for k, v in value.items():
            child = node.get("properties", {}).get(k) or (extra if isinstance(extra, dict) else None)
            if child:
                value[k] = _coerce_numbers(v, child, root)
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        value[:] = [_coerce_numbers(v, node["items"], root) for v in value]
    return value


def _model_dir_problems(name: str, path: Path) -> list[str]:
    """An existing local model directory the workflow will train: config.json it can read,
    an architecture it can estimate, a tokenizer and weights (what `transformers` loads)."""
    key = f"models.{name}.path"
    if not path.is_dir():
        return [f"{key}: {path} is not a directory (a HF model directory: config.json, weights, tokenizer)"]
    if not any(path.iterdir()):
        # an empty directory is a placeholder (a mount not populated yet; the dry-run tests'
        # stand-ins): the architecture comes from the catalog and the loader reports it at train
        return []
    out = []
    if not (path / "config.json").is_file():
        out.append(f"{key}: {path / 'config.json'} is missing")
    else:
        try:
            catalog.model(str(path), allow_moe=True)  # experts are modelled (estimate.states)
        except (ValueError, OSError, KeyError) as e:
            out.append(f"{key}: {str(e).strip(chr(39))}")
    tokenizer = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if not any((path / f).is_file() for f in tokenizer):
        out.append(f"{key}: no tokenizer in {path} (expected one of {', '.join(tokenizer)})")
    weights = [*path.glob("*.safetensors"), *path.glob("pytorch_model*.bin"), *path.glob("adapter_model.*")]
    if not weights:
        out.append(f"{key}: no weights in {path} (expected *.safetensors or pytorch_model*.bin)")
    return out


def _context_problems(cfg: WorkflowConfig) -> list[str]:
    """data.max_len (or search.seq_len) beyond a model's context (max_position_embeddings)."""
    out = []
    seq = cfg.seq_len
    key = "search.seq_len" if cfg.raw["search"].get("seq_len") else "data.max_len"
    for name in cfg.models:
        source = cfg.arch_source(name)
        build = cfg.model(name).build
        if build and source != cfg.model(name).path:
            source = build  # not built yet: the architecture is the config it is built from
        try:
            arch = catalog.model(source, allow_moe=True)
        except (ValueError, OSError, KeyError):
            continue  # reported by the model checks
        context = arch.max_position_embeddings
        if context and seq > context:
            out.append(f"{key}: {seq} is beyond models.{name}'s context of {context} tokens (max_position_embeddings)")
    return out


def _gpu_problems(cfg: WorkflowConfig) -> list[str]:
    """Unknown GPU names (in `gpus` and `slurm.gpu_types`) and planning-only GPUs in a training run."""
    out = []
    gpus = catalog.load_gpus()
    for i, name in enumerate(cfg.gpus):
        try:
            gpu = catalog.gpu(name)
        except ValueError as e:
            out.append(f"gpus[{i}]: {e} (allowed: {', '.join(sorted(gpus))})")
            continue
        if gpu.planning_only and not cfg.plan_only:
            out.append(
                f"gpus[{i}]: {name} is for planning only ({gpu.planning_reason.strip()}); "
                "set plan_only: true to estimate and select for it without training"
            )
    for name in cfg.slurm.get("gpu_types") or {}:
        # a site-wide section may list GPU types this config does not use, but not a typo
        if name not in cfg.gpus and name not in gpus:
            out.append(f"slurm.gpu_types.{name}: not a GPU name (allowed: {', '.join(sorted(gpus))})")
    return out


def _semantic_problems(cfg: WorkflowConfig) -> list[str]:
    from memfit.train.run_config import option_problems

    raw, out = cfg.raw, _gpu_problems(cfg)
    if raw.get("headroom", AUTO) == AUTO and "cpu" in raw["gpus"]:  # the margin is a GPU's measured error
        out.append("headroom: 'auto' (or omitted) has no measured margin for the cpu device: give one, e.g. 0.10")
    for name in cfg.models:
        m = cfg.model(name)
        if m.build is not None and not Path(m.build).exists():
            out.append(f"models.{name}.build: file {m.build} does not exist")
        if m.build is None and m.path and Path(m.path).exists() and not cfg.plan_only:
            out += _model_dir_problems(name, Path(m.path))
        if not cfg.will_have_weights(name):
            if not cfg.plan_only:
                out.append(
                    f"models.{name}.path: {m.path!r} is not a model directory; training needs weights (or set plan_only: true)"
                )
            try:
                catalog.model(m.arch or name, allow_moe=True)
            except ValueError as e:
                out.append(f"models.{name}: no weights and no architecture: {e}")
    if not out:
        out += _context_problems(cfg)
    if not cfg.plan_only:
        # the workflow always runs verify_resume after training (memfit.workflow.resume_check), which
        # resumes from an earlier checkpoint than the final one
        if raw["train"].get("save_every", 1) == 0:
            out.append(
                "train.save_every: 0 writes no checkpoints, but verify_resume needs two "
                "(use a step count below the run's steps, or plan_only: true)"
            )
    search = raw["search"]
    if (
        "dpo" in cfg.methods
        and "adapter" in search.get("ref", [])
        and set(search.get("finetune", ["full"])) == {"full"}
    ):
        out.append(
            "search.ref: 'adapter' (the reference = the base model under the LoRA adapter) needs "
            "finetune lora or qlora, but search.finetune is [full]; drop 'adapter' or add lora"
        )
    for method in cfg.methods:
        if method not in raw["train"]:
            out.append(f"train.{method}: missing (methods lists {method})")
        src = raw["data"].get(method)
        if not cfg.plan_only:
            if not src:
                out.append(f"data.{method}: missing (methods lists {method})")
            elif not Path(src).exists():
                out.append(f"data.{method}: {src} does not exist")
    for method in ("sft", "dpo"):
        t = raw["train"].get(method)
        if t is not None:
            out += option_problems(
                method,
                t.get("loss_on", "response"),
                bool(t.get("packing", False)),
                t.get("export", "merged"),
                list(raw["search"].get("finetune", ["full"])),
            )
    if not out:
        from memfit.workflow.search_checks import search_problems

        # no trainable combination (each real reason once), a GPU that can run none of them,
        # a search key that does nothing
        out += search_problems(cfg)
    return out
