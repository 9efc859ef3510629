"""Snakemake script: candidates_table -> memfit.results.write_parquet."""

from memfit.results import write_parquet
from memfit.workflow.pipeline import log_to

log_to(snakemake.log[0])
write_parquet(selected=snakemake.input.selected, out=snakemake.output[0])
