"""Snakemake script: probe_candidate -> memfit.workflow.pipeline.probe_candidate."""

from memfit.workflow.pipeline import log_to, probe_candidate
from memfit.workflow.probe import require_target_device

log_to(snakemake.log[0])
# a GPU this machine lacks: stop before the ranks start (they would measure the CPU)
require_target_device(snakemake.wildcards.gpu, bool(snakemake.config.get("plan_only")), "probe_candidate")
probe_candidate(
    snakemake.config,
    snakemake.wildcards.method,
    snakemake.wildcards.cand,
    snakemake.input.candidates,
    snakemake.params.model_path,
    snakemake.params.data_dir,
    snakemake.output[0],
    snakemake.log[0],
)
