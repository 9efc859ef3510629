"""Snakemake script: prepare_data -> memfit.workflow.pipeline.prepare_data (model check, then tokenize),
then the rows it kept against one global batch (before calibration and probes need them)."""

import sys
from pathlib import Path

from memfit.workflow.check_config import lr_warnings
from memfit.workflow.config import ConfigError, WorkflowConfig
from memfit.workflow.pipeline import log_to, prepare_data
from memfit.workflow.search_checks import rows_problem

log_to(snakemake.log[0])
# a learning rate outside the usual range: a warning in the rule's log and on Snakemake's console
for warning in lr_warnings(WorkflowConfig.of(snakemake.config), [snakemake.wildcards.method]):
    for stream in (sys.stderr, sys.__stderr__):
        print(f"memfit: {warning}", file=stream, flush=True)
prepare_data(
    snakemake.wildcards.method,
    snakemake.input.source,
    snakemake.params.tokenizer,
    Path(snakemake.output.stats).parent,
    max_len=snakemake.params.max_len,
    eval_fraction=snakemake.params.eval_fraction,
    seed=snakemake.params.seed,
    assistant_loss=snakemake.params.assistant_loss,
    progress=True,
)
# a failed job's outputs are removed by Snakemake: nothing half-checked stays behind
problem = rows_problem(WorkflowConfig.of(snakemake.config), snakemake.wildcards.method, snakemake.output.stats)
if problem:
    raise ConfigError(problem)
