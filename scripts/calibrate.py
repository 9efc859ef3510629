"""Snakemake script: calibrate -> memfit.workflow.calibrate.calibrate."""

from memfit.workflow.calibrate import calibrate
from memfit.workflow.pipeline import log_to

log_to(snakemake.log[0])
w = snakemake.wildcards
calibrate(snakemake.config, w.model, snakemake.output[0], snakemake.log[0], gpu=w.gpu)
