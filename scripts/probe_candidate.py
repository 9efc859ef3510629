"""Snakemake script: probe_candidate -> memfit.workflow.pipeline.probe_candidate."""

from memfit.workflow.pipeline import log_to, probe_candidate

log_to(snakemake.log[0])
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
