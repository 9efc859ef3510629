rule train:
    # DeepSpeed SFT or DPO with the selected configuration. Checkpoints live beside the
    # outputs and are not declared, so a re-run after a crash resumes from the newest one.
    input:
        run=res("{model}/{gpu}/{method}/run.json"),
        # the ranking an OOM fallback continues with (memfit.workflow.fallback)
        selected=res("{model}/{gpu}/{method}/selected.json"),
        policy=policy_input,
        data=res("{model}/data/{method}/stats.json"),
    output:
        # written last, after train/model (merged model or adapter only, train.<method>.export)
        summary=res("{model}/{gpu}/{method}/train/summary.json"),
    log:
        logf("{model}/{gpu}/{method}/train.log"),
    benchmark:
        bench("{model}/{gpu}/{method}/train.tsv")
    conda:
        CONDA_ENV
    threads: rank_threads
    resources:
        **slurm_resources("train"),
    params:
        nproc=nproc,
    script:
        "../../scripts/train.py"


rule verify_resume:
    # Resume the finished run from its previous checkpoint; compare with the uninterrupted run.
    input:
        run=res("{model}/{gpu}/{method}/run.json"),
        summary=res("{model}/{gpu}/{method}/train/summary.json"),
    output:
        res("{model}/{gpu}/{method}/verify_resume.json"),
    log:
        logf("{model}/{gpu}/{method}/verify_resume.log"),
    benchmark:
        bench("{model}/{gpu}/{method}/verify_resume.tsv")
    conda:
        CONDA_ENV
    threads: rank_threads
    resources:
        **slurm_resources("verify_resume"),
    params:
        nproc=nproc,
    script:
        "../../scripts/verify_resume.py"
