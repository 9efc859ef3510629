"""Snakemake script: select_config -> memfit.workflow.pipeline.select_config."""

from memfit.estimate.selection import check_probe_files
from memfit.workflow.pipeline import log_to, select_config

log_to(snakemake.log[0])
w = snakemake.wildcards
# a probe counts only for the GPU it ran on (memfit.estimate.selection.WrongDevice names both)
check_probe_files(snakemake.input.probes, w.gpu)
select_config(
    snakemake.config,
    w.model,
    w.gpu,
    w.method,
    snakemake.input.candidates,
    snakemake.input.probes,
    snakemake.params.model_path,
    snakemake.params.data_dir,
    snakemake.params.train_dir,
    dict(snakemake.output.items()),
)
