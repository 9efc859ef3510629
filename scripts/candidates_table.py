"""Snakemake script: candidates_table -> memfit.results.write_parquet."""

from memfit.pipeline import log_to
from memfit.results import write_parquet

log_to(snakemake.log[0])
write_parquet(selected=snakemake.input.selected, out=snakemake.output[0])
