"""Snakemake script: prepare_data -> memfit.data.prepare."""

from pathlib import Path

from memfit.data import prepare
from memfit.pipeline import log_to

log_to(snakemake.log[0])
prepare(
    snakemake.wildcards.method,
    snakemake.input.source,
    snakemake.params.tokenizer,
    Path(snakemake.output.stats).parent,
    max_len=snakemake.params.max_len,
    eval_fraction=snakemake.params.eval_fraction,
    seed=snakemake.params.seed,
    progress=True,
)
