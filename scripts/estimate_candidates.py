"""Snakemake script: estimate_candidates -> memfit.workflow.pipeline.estimate_candidates, after the
prepared rows are checked against the global batch (a train.global_batch raised since prepare_data ran)."""

from memfit.workflow.config import ConfigError, WorkflowConfig
from memfit.workflow.pipeline import estimate_candidates, log_to
from memfit.workflow.search_checks import rows_problem

log_to(snakemake.log[0])
w = snakemake.wildcards
if snakemake.input.data:  # none in a plan (plan_only: no data is prepared)
    problem = rows_problem(WorkflowConfig.of(snakemake.config), w.method, snakemake.input.data[0])
    if problem:
        raise ConfigError(problem)
calibration = snakemake.input.calibration[0] if snakemake.input.calibration else None
estimate_candidates(snakemake.config, w.model, w.gpu, w.method, snakemake.output[0], calibration)
