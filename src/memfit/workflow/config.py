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
import functools
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit.estimate.models import catalog
from memfit.estimate.rows import Budget, derived_budget
from memfit.methods import kernels_problems, speed_problems
from memfit.methods import shape as method_shape
from memfit.space import Candidate, engine_key, enumerate_space
from memfit.units import GIB, MIB
from memfit.workflow.config_checks import (
    AUTO,  # headroom auto or absent: the derived margin (rows.derived_budget)
    DPO_KEYS,
    KTO_MIN_MICRO_BATCH,
)

if TYPE_CHECKING:
    from memfit.train.run_config import RunConfig

SCHEMA = Path(__file__).resolve().parents[3] / "workflow" / "schemas" / "config.schema.yaml"
# Every output of the workflow lives under results/, its logs under logs/, its benchmarks under
# benchmarks/; a config with `run: NAME` under results/NAME/, logs/NAME/ and benchmarks/NAME/, so that
# several configurations live side by side in one clone (WorkflowConfig.results_dir).
RESULTS, LOGS, BENCHMARKS = "results", "logs", "benchmarks"


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
    def run_name(self) -> str | None:
        """`run:`, the name this configuration's outputs live under; None: the clone's default run."""
        return self.raw.get("run") or None

    def _under(self, top: str) -> str:
        return f"{top}/{self.run_name}" if self.run_name else top

    @property
    def results_dir(self) -> str:
        """Where every output lives: results/, or results/<run> for a named run."""
        return self._under(RESULTS)

    @property
    def logs_dir(self) -> str:
        return self._under(LOGS)

    @property
    def benchmarks_dir(self) -> str:
        return self._under(BENCHMARKS)

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
        return [f"{self.results_dir}/{model}/{gpu}/calibration.json"]

    def calibration_engines(self) -> list[str]:
        """The engines (memfit.space.engine_key) the calibrate rule measures: those of every candidate
        of every method. The rule's params, so that a search that adds an engine (compile, kernels,
        a ZeRO stage) measures again instead of leaving the new engine unmeasured."""
        return sorted({engine_key(c) for m in self.methods for c in self.candidates(m)})

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
        if not method_shape(method).reference:
            axes.pop("ref", None)
            fixed["ref"] = None  # no reference model: such ids carry no ref-<mode> (memfit.space.Candidate.id)
        world = self.world_size
        global_batch = int(self.raw["train"]["global_batch"])
        out = []
        packing = bool((self.raw["train"].get(method) or {}).get("packing", False))
        for cand in enumerate_space(axes, fixed=fixed):
            if world % cand.sequence_parallel:
                continue  # a sequence-parallel group must fit the ranks evenly
            if speed_problems(method, cand.padding_free, cand.sequence_parallel):
                continue  # padding_free: methods.PADDING_FREE_METHODS, no sequence parallelism (search_checks says why)
            if cand.compile and self.compile_problem():
                continue  # no C++ compiler for inductor's CPU backend (search_checks says why)
            if kernels_problems(method, cand.kernels) or (cand.kernels == "liger" and self.kernels_problem()):
                continue  # liger: sft and dpo, where its package, a CUDA GPU and the model types allow (search_checks says why)
            if method == "kto" and cand.micro_batch < KTO_MIN_MICRO_BATCH:
                continue  # memfit.train.run_config.preference_problems: KTO's KL batch needs two rows
            if packing and cand.sequence_parallel > 1 and cand.attn != "flash":
                continue  # packed rows under Ulysses need flash (memfit.train.sequence_parallel.PACKING_NEEDS_FLASH)
            per_step = cand.micro_batch * cand.data_parallel(world)
            if global_batch % per_step:
                continue  # this micro batch cannot make the global batch on this many ranks
            out.append(dataclasses.replace(cand, grad_accum=global_batch // per_step))
        if (
            not out
            and method == "kto"
            and all(m < KTO_MIN_MICRO_BATCH for m in self.raw["search"].get("micro_batch", [1]))
        ):
            raise ValueError(
                f"search.micro_batch: kto needs {KTO_MIN_MICRO_BATCH} or more rows per micro batch (its KL batch pairs each row with another row's completion)"
            )
        if not out:
            raise ValueError(
                f"train.global_batch={global_batch} is not a multiple of micro_batch x ranks for any "
                f"micro_batch in {self.raw['search'].get('micro_batch')} with {world} ranks"
            )
        return out

    def compile_problem(self) -> str | None:
        """Why `search.compile`'s compiled candidates cannot run where this config trains: on the
        `cpu` device without a C++ compiler for inductor (memfit.train.compile.compile_problem);
        None when no GPU entry is `cpu` (CUDA compiles with Triton) or nothing is compiled."""
        if True not in self.raw["search"].get("compile", [False]) or "cpu" not in self.gpus or self.plan_only:
            return None
        from memfit.train.compile import compile_problem  # imports torch: only when compile is searched

        return compile_problem()

    def kernels_problem(self) -> str | None:
        """Why `search.kernels`' liger candidates cannot run where this config trains, in
        memfit.train.liger's words: no liger-kernel package or no CUDA GPU on this machine
        (`liger.runtime_problem`: the `cpu` device runs Liger only under Triton's interpreter,
        TRITON_INTERPRET=1, for tests), or a model of `models:` whose type Liger has no kernels for.
        A plan (plan_only) trains elsewhere: the machine is not asked, and the model types only
        where the package is installed here (else `memfit launch` refuses them where training runs).
        None when nothing is searched with liger."""
        if "liger" not in self.raw["search"].get("kernels", ["none"]):
            return None
        return self._liger_problem

    @functools.cached_property
    def _liger_problem(self) -> str | None:
        from memfit.train import liger  # imports torch: only when liger is searched

        if not self.plan_only and (why := liger.runtime_problem()):
            return why
        if not liger.installed():
            return None
        for name in self.models:
            model_type, where = self._model_type(name)
            if model_type is not None and (why := liger.model_problem(model_type, where)):
                return why
        return None

    def _model_type(self, name: str) -> tuple[str | None, str]:
        """The HF model type of `models.<name>` and where it comes from: its config.json (the
        weights' or the one the demo builds from), else its catalog card; None where neither reads."""
        m = self.model(name)
        for config in (Path(m.path) / "config.json" if m.path else None, Path(m.build) if m.build else None):
            if config is not None and config.is_file():
                return json.loads(config.read_text()).get("model_type"), str(config)
        try:
            return catalog.model(self.arch_source(name), allow_moe=True).model_type, f"models.{name}"
        except ValueError:
            return None, f"models.{name}"  # the config checks name an unknown model

    # -- one run ---------------------------------------------------------------------------
    def run_config(self, method: str, cand: dict[str, Any], model_path: str, data_dir: str, out_dir: str) -> RunConfig:
        """The `RunConfig` of one candidate: the config's `train` section plus the method's."""
        from memfit.train import preference
        from memfit.train.run_config import RunConfig

        train = self.raw["train"]
        per_method = dict(train[method])
        # the method's own hyperparameters: DPO's (memfit.train.losses.DPOConfig) and the preference
        # methods' under TRL's names (memfit.train.preference); a key of another method stays and
        # RunConfig refuses it, naming it (memfit.workflow.config_checks names train.<method>.<key>)
        dpo = {k: per_method.pop(k) for k in DPO_KEYS if k in per_method} if method == "dpo" else {}
        pref = {k: per_method.pop(k) for k in preference.hyperparameters(method) if k in per_method}
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
            pref=pref,
            ref_model_path=model_path if method_shape(method).reference else None,
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

    def data_source(self, method: str) -> str | None:
        """The data `method` trains on: `data.<method>`, else (rm, orpo, simpo, kto) the DPO pairs
        `data.dpo` (KTO splits each pair into a desirable and an undesirable row)."""
        data = self.raw["data"]
        if data.get(method) or method_shape(method).data == "sft":
            return data.get(method)
        return data.get("dpo")

    def data_key(self, method: str) -> str:
        """The config key `data_source(method)` comes from (for messages)."""
        return f"data.{method}" if self.raw["data"].get(method) or method_shape(method).data == "sft" else "data.dpo"

    def run_dir(self, model: str, gpu: str, method: str) -> str:
        return f"{self.results_dir}/{model}/{gpu}/{method}"

    def policy_path(self, model: str, gpu: str, method: str) -> str | None:
        """What training starts from: the SFT output for every other method when the workflow
        trains SFT (for dpo and kto the reference too), else the base model."""
        if method != "sft" and "sft" in self.methods:
            return f"{self.run_dir(model, gpu, 'sft')}/train/model"
        return self.model_path(model)

    def policy_inputs(self, model: str, gpu: str, method: str) -> list[str]:
        if method != "sft" and "sft" in self.methods:
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
        from memfit.workflow.config_checks import semantic_problems

        problems += semantic_problems(WorkflowConfig(config))
    if problems:
        raise ConfigError("invalid memfit config:\n  " + "\n  ".join(problems))
    from memfit.workflow.search_checks import search_warnings

    for warning in search_warnings(WorkflowConfig(config)):
        print(f"memfit: warning: {warning}", file=sys.stderr)


def _detect_gpus(config: dict[str, Any]) -> list[str]:
    """`gpus: [detect]` becomes the catalog name of this machine's GPU (nvidia-smi), in place, so
    that the {gpu} wildcard and every stage see the name."""
    from memfit.estimate.models.detect import DETECT, DetectError, detect_gpu, smi_devices

    for i, name in enumerate(config["gpus"]):
        if name == DETECT:
            try:
                config["gpus"][i] = detect_gpu()
                here = len(smi_devices())
            except DetectError as e:
                return [f"gpus[{i}]: {e} (on the command line: --config 'gpus=[h100-80gb]')"]
            if int(config["num_gpus"]) > here and not config.get("plan_only"):
                # the detected GPUs are this machine's: a job cannot start more ranks than it has
                return [
                    f"num_gpus: {config['num_gpus']} but this machine has {here} {config['gpus'][i]} "
                    f"(gpus: [detect], nvidia-smi); set num_gpus: {here} (GPUs per node), or name the "
                    "GPU and plan for the larger node with plan_only: true"
                ]
    return []


def _coerce_numbers(value: Any, node: dict[str, Any], root: dict[str, Any]) -> Any:
    """Numbers and booleans written as strings where the schema wants one: YAML 1.1 reads `1e-5`
    (no dot) as a string, and `snakemake --config` passes `true` and nested values as strings
    (it reads `True` only: snakemake.cli.parse_config)."""
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
    if isinstance(value, str) and types == ["boolean"] and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if isinstance(value, dict):
        extra = node.get("additionalProperties")
        for k, v in value.items():
            child = node.get("properties", {}).get(k) or (extra if isinstance(extra, dict) else None)
            if child:
                value[k] = _coerce_numbers(v, child, root)
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        value[:] = [_coerce_numbers(v, node["items"], root) for v in value]
    return value
