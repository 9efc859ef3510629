rule report:
    # One self-contained HTML page: selection, memory per candidate, curves, resume check.
    input:
        selected=expand(
            "results/{model}/{gpu}/{method}/selected.json",
            model=MODELS,
            gpu=GPUS,
            method=METHODS,
        ),
        summaries=report_inputs("train/summary.json"),
        resume=report_inputs("verify_resume.json"),
        data=data_stats_inputs(),
    output:
        report(
            "results/report.html",
            caption="../report/report.rst",
            category="Report",
        ),
    log:
        "logs/report.log",
    conda:
        CONDA_ENV
    script:
        "../../scripts/report.py"


rule candidates_table:
    # Every candidate of every run as one tidy table: memfit.results.load("results") reads the same.
    input:
        selected=expand(
            "results/{model}/{gpu}/{method}/selected.json",
            model=MODELS,
            gpu=GPUS,
            method=METHODS,
        ),
        summaries=report_inputs("train/summary.json"),
        resume=report_inputs("verify_resume.json"),
    output:
        "results/candidates.parquet",
    log:
        "logs/candidates_table.log",
    conda:
        CONDA_ENV
    script:
        "../../scripts/candidates_table.py"
