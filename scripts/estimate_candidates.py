"""Snakemake script: estimate_candidates -> memfit.pipeline.estimate_candidates."""

from memfit.pipeline import estimate_candidates, log_to

log_to(snakemake.log[0])
w = snakemake.wildcards
estimate_candidates(snakemake.config, w.model, w.gpu, w.method, snakemake.output[0])
