"""Snakemake script: estimate_candidates -> memfit.workflow.pipeline.estimate_candidates."""

from memfit.workflow.pipeline import estimate_candidates, log_to

log_to(snakemake.log[0])
w = snakemake.wildcards
calibration = snakemake.input.calibration[0] if snakemake.input.calibration else None
estimate_candidates(snakemake.config, w.model, w.gpu, w.method, snakemake.output[0], calibration)
