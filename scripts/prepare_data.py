"""Snakemake script: prepare_data -> memfit.workflow.pipeline.prepare_data (model check, then tokenize)."""

from pathlib import Path

from memfit.workflow.pipeline import log_to, prepare_data

log_to(snakemake.log[0])
prepare_data(
    snakemake.wildcards.method,
    snakemake.input.source,
    snakemake.params.tokenizer,
    Path(snakemake.output.stats).parent,
    max_len=snakemake.params.max_len,
    eval_fraction=snakemake.params.eval_fraction,
    seed=snakemake.params.seed,
    progress=True,
)
