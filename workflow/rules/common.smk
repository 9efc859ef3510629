import sys
from pathlib import Path

sys.path.insert(0, str(Path(workflow.basedir) / "src"))

from memfit.workflow.config import WorkflowConfig  # noqa: E402

# Schema plus catalog names, files and method sections: a bad config stops here,
# before any job starts, naming the key and the allowed values. Read and checked once;
# CFG answers every question about models, paths and the search space.
CFG = WorkflowConfig.load(config)

MODELS = CFG.models
# Where this configuration's outputs, logs and benchmarks live: results/, logs/, benchmarks/, or
# results/<run>/, logs/<run>/, benchmarks/<run>/ for a config with `run: <name>` (several
# configurations side by side in one clone; memfit.workflow.config.WorkflowConfig.results_dir).
RESULTS = CFG.results_dir
LOGS = CFG.logs_dir
BENCHMARKS = CFG.benchmarks_dir
GPUS = CFG.gpus
METHODS = CFG.methods
PLAN_ONLY = CFG.plan_only
ON_GPU = any(g != "cpu" for g in GPUS)
# build_demo_model applies only to models whose entry has `build:`; every other model
# directory (the normal case: `path:` to a local HF model) is an input that already exists.
# "(?!)" matches nothing, for a config with no built model.
BUILT_MODELS = "|".join(CFG.built_models()) or "(?!)"


# GPU clusters run rules in the pinned CUDA env; the CPU default in the CPU env. Without conda on
# PATH under a conda deployment (the slurm profile's use-conda): none for a dry run (a plan-only
# preview, with a note), a stop naming the way out for a real run (memfit.workflow.slurm.conda_env).
def _conda_env():
    import shutil

    from snakemake_interface_executor_plugins.settings import DeploymentMethod

    from memfit.workflow import slurm

    return slurm.conda_env(
        "../../envs/memfit-gpu.yaml" if ON_GPU else "../../envs/memfit-cpu.yaml",
        uses_conda=DeploymentMethod.CONDA
        in workflow.deployment_settings.deployment_method,
        dryrun=bool(getattr(workflow.output_settings, "dryrun", False)),
        conda_found=shutil.which("conda") is not None,
    )


CONDA_ENV = _conda_env()


wildcard_constraints:
    model="|".join(MODELS) if MODELS else "[a-z0-9._-]+",
    gpu="[a-z0-9._-]+",
    method="|".join(METHODS),
    cand="[A-Za-z0-9.-]+",


def res(path):
    """`path` (wildcards kept) under this run's results directory."""
    return f"{RESULTS}/{path}"


def logf(path):
    return f"{LOGS}/{path}"


def bench(path):
    return f"{BENCHMARKS}/{path}"


def model_dir(w):
    """The model's weights directory (built by build_demo_model when the config says so)."""
    return CFG.model_path(w.model)


def build_config(w):
    """The HF config.json a built model comes from (only built models reach this rule)."""
    return CFG.model(w.model).build or []


def model_input(w):
    return CFG.model_inputs(w.model)


def policy_dir(w):
    """What training starts from: the base model for SFT, the SFT output for DPO."""
    return CFG.policy_path(w.model, w.gpu, w.method)


def policy_input(w):
    return CFG.policy_inputs(w.model, w.gpu, w.method)


def calibration_input(w):
    return CFG.calibration_inputs(w.model, w.gpu)


def prepared_data(w):
    # calibrate waits for prepare_data of every method: its model check stops a broken model
    # directory (a missing tokenizer, unreadable weights) before a minute of calibration
    return [f"{RESULTS}/{w.model}/data/{m}/stats.json" for m in METHODS]


def data_input(w):
    return [] if PLAN_ONLY else [f"{RESULTS}/{w.model}/data/{w.method}/stats.json"]


def data_source(w):
    # data.<method>, else (rm, orpo, simpo, kto) the DPO pairs (WorkflowConfig.data_source)
    return CFG.data_source(w.method)


def probe_outputs(w):
    """The probes estimate_candidates chose (a checkpoint: known once it has run)."""
    table = checkpoints.estimate_candidates.get(**w).output[0]
    import json

    ids = json.loads(Path(table).read_text())["probe"]
    return [f"{RESULTS}/{w.model}/{w.gpu}/{w.method}/probes/{i}.json" for i in ids]


def estimate_settings(w):
    """Every config value estimate_candidates reads: a change re-runs the estimate."""
    keys = (
        "search",
        "num_gpus",
        "num_nodes",
        "cpu_memory_mib",
        "host_memory_gib",
        "headroom",
        "plan_only",
        "estimate",
    )
    return {k: config.get(k) for k in keys} | {
        "probe": config["probe"],
        "global_batch": config["train"]["global_batch"],
        "max_len": config["data"]["max_len"],
        # the probes (and so the selection) run with the kernels training will run
        "deterministic": config["train"].get("deterministic", False),
    }


def train_settings(w):
    """Every config value the run config is made of: a change re-runs select_config and train."""
    common = (
        "global_batch",
        "seed",
        "save_every",
        "keep_last",
        "eval_every",
        "log_every",
        "deterministic",
    )
    return {k: config["train"].get(k) for k in common} | {
        w.method: config["train"][w.method]
    }


def nproc(w):
    return int(config["num_gpus"])


def rank_threads(w):
    # CPU ranks each use one core; a GPU job asks for a few cores per GPU.
    return int(config["num_gpus"]) * (1 if w.gpu == "cpu" else 4)


# SLURM resources of every job (memfit.workflow.slurm.rule_resources), read by the executor plugin under
# --profile slurm; a local run uses only `gpu`. Rank-running rules take nodes, GPUs and memory
# from the target and the estimate's host RAM: the probed candidate's row, or the selected run.
SLURM_RANK_KEYS = (
    "nodes",
    "tasks",
    "gpu",
    "gpu_model",
    "gres",
    "constraint",
    "cpus_per_gpu",
    "mem_mb",
    "runtime",
    "slurm_partition",
    "slurm_account",
)


def _slurm_host_bytes(name, w, input):
    from memfit.workflow import slurm

    if name == "probe_candidate":
        return slurm.probe_host_bytes(input.candidates, w.cand)
    if name == "calibrate":
        return slurm.calibrate_host_bytes(CFG.model_path(w.model))
    return slurm.run_host_bytes(input.run)


def _slurm_rank_resource(name, key):
    def value(wildcards, input):
        from memfit.workflow import slurm

        host = _slurm_host_bytes(name, wildcards, input)
        return slurm.rule_resources(config, name, wildcards.gpu, host).get(key)

    return value


def slurm_resources(name):
    """What `resources:` holds for `name`: callables per key for rank-running rules (a None
    value is dropped), the runtime and partition/account for the others."""
    from memfit.workflow import slurm

    if name in slurm.RANK_RULES:
        return {k: _slurm_rank_resource(name, k) for k in SLURM_RANK_KEYS}
    return slurm.rule_resources(config, name, gpu="cpu")


def report_inputs(name):
    """Per-run files the report reads; a plan-only run has no training outputs."""
    if PLAN_ONLY:
        return []
    return expand(
        res("{model}/{gpu}/{method}/{name}"),
        model=MODELS,
        gpu=GPUS,
        method=METHODS,
        name=name,
    )


def data_stats_inputs():
    if PLAN_ONLY:
        return []
    return expand(res("{model}/data/{method}/stats.json"), model=MODELS, method=METHODS)


def all_outputs():
    return [res("report.html"), res("candidates.parquet")]
