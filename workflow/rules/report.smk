rule report:
    # One self-contained HTML page: selection, memory per candidate, curves, resume check.
    input:
        selected=expand(
            res("{model}/{gpu}/{method}/selected.json"),
            model=MODELS,
            gpu=GPUS,
            method=METHODS,
        ),
        summaries=report_inputs("train/summary.json"),
        resume=report_inputs("verify_resume.json"),
        data=data_stats_inputs(),
    output:
        report(
            res("report.html"),
            caption="../report/report.rst",
            category="Report",
        ),
    log:
        logf("report.log"),
    conda:
        CONDA_ENV
    params:
        # the "Run facts" section reads config/ and benchmarks/ here, wherever RESULTS is
        facts_root=".",
        bench_dir=BENCHMARKS,
    script:
        "../../scripts/report.py"


rule candidates_table:
    # Every candidate of every run as one tidy table: memfit.results.load(RESULTS) reads the same.
    input:
        selected=expand(
            res("{model}/{gpu}/{method}/selected.json"),
            model=MODELS,
            gpu=GPUS,
            method=METHODS,
        ),
        summaries=report_inputs("train/summary.json"),
        resume=report_inputs("verify_resume.json"),
    output:
        res("candidates.parquet"),
    log:
        logf("candidates_table.log"),
    conda:
        CONDA_ENV
    script:
        "../../scripts/candidates_table.py"
