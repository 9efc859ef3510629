"""Snakemake script: verify_resume -> memfit.workflow.resume_check.verify_resume."""

from memfit.workflow.pipeline import log_to
from memfit.workflow.resume_check import verify_resume

log_to(snakemake.log[0])
verify_resume(
    snakemake.input.run,
    snakemake.params.nproc,
    snakemake.output[0],
    snakemake.log[0],
    nnodes=snakemake.config.get("num_nodes", 1),
)
