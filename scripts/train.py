"""Snakemake script: train -> memfit.workflow.pipeline.train (resumes from the newest checkpoint)."""

from memfit.workflow.pipeline import log_to, train

log_to(snakemake.log[0])
train(
    snakemake.input.run,
    snakemake.params.nproc,
    snakemake.log[0],
    snakemake.config.get("num_nodes", 1),
    selected_json=snakemake.input.selected,
)
