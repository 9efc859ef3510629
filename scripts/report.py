"""Snakemake script: report -> memfit.report.write_report."""

from memfit.report import write_report
from memfit.workflow.pipeline import log_to

log_to(snakemake.log[0])
write_report(
    selected=snakemake.input.selected,
    summaries=snakemake.input.summaries,
    resume=snakemake.input.resume,
    data_stats=snakemake.input.data,
    out_html=snakemake.output[0],
    facts_root=snakemake.params.facts_root,  # the working directory, also for results/<run>/report.html
    bench_dir=snakemake.params.bench_dir,  # this run's benchmarks/ (benchmarks/<run>/ for a named run)
)
