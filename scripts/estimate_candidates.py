"""Snakemake script: estimate_candidates -> memfit.workflow.pipeline.estimate_candidates, after the
prepared rows are checked against the global batch (a train.global_batch raised since prepare_data ran)."""

import sys
import time

from memfit.estimate.trace import trace
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
t0 = time.perf_counter()


def say(line: str) -> None:  # progress in the rule's log (log_to: stderr), with the seconds so far
    print(f"estimate_candidates [{time.perf_counter() - t0:6.1f} s] {line}", file=sys.stderr, flush=True)


say(f"estimating the candidates of {w.model} on {w.gpu} ({w.method})")
with trace.progress_to(say):  # a line as each traced shape starts and ends (memfit.estimate.trace.trace)
    stats = snakemake.input.data[0] if snakemake.input.data else None  # prices padding_free on real tokens
    result = estimate_candidates(snakemake.config, w.model, w.gpu, w.method, snakemake.output[0], calibration, stats)
rows = result["rows"]
say(f"estimated {len(rows)} candidates, {sum(r['fits'] and not r['invalid'] for r in rows)} predicted to fit")
