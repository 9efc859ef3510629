# memfit: fine-tune LLMs (SFT, DPO) on DeepSpeed without out-of-memory surprises.
#   snakemake --cores all                  the embedded CPU default (config/config.yaml)
#   snakemake --cores all --profile slurm  the same DAG on a SLURM cluster


import sys

from snakemake.utils import min_version

min_version("8.20")

sys.path.insert(0, str(Path(workflow.basedir) / "src"))
from memfit.workflow.config import load_yaml  # noqa: E402

# The embedded default, unless the user names their own with --configfile (which then
# replaces it instead of being merged into it: a cluster config must not inherit the demo model).
# Snakemake's own reader says only "not valid JSON or YAML": read it first, so that a syntax error
# names the file, line and column (a --configfile is read by Snakemake before this file runs:
# `memfit check-config FILE` names its line and column).
if not workflow.overwrite_configfiles:
    load_yaml(Path(workflow.basedir) / "config" / "config.yaml")

    configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/plan.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/report.smk"


# On one machine, one rank-running job at a time (memfit.workflow.slurm.local_gpu_slots).
from memfit.workflow.slurm import local_gpu_slots  # noqa: E402

GPU_SLOTS = local_gpu_slots(
    config, local_exec=workflow.local_exec, named="gpu" in workflow.global_resources
)
if GPU_SLOTS is not None:
    workflow.register_resource("gpu", GPU_SLOTS)


# On the CPU accelerator on one machine, ranks fork from one process that imported torch, DeepSpeed
# and transformers once (memfit.workflow.ranks; MEMFIT_RANK_SERVER=off: none).
from memfit.workflow import ranks  # noqa: E402


onstart:
    ranks.start(config, local_exec=workflow.local_exec)


onsuccess:
    ranks.stop()


onerror:
    ranks.stop()


# Short rules run where snakemake runs, never as SLURM jobs: select_config reads a few JSON files,
# report renders one page, candidates_table writes one table (seconds each); queueing them would
# cost more than running them.
localrules:
    all,
    select_config,
    report,
    candidates_table,


rule all:
    input:
        all_outputs(),
