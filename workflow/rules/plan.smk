rule calibrate:
    # What a training step costs on this machine: the model's own 1- and 4-layer steps under
    # each DeepSpeed engine of the search space (memfit.train.calibrate), on the ranks probes use.
    input:
        model=model_input,
        data=prepared_data,
    output:
        res("{model}/{gpu}/calibration.json"),
    log:
        logf("{model}/{gpu}/calibrate.log"),
    benchmark:
        bench("{model}/{gpu}/calibrate.tsv")
    conda:
        CONDA_ENV
    threads: rank_threads
    resources:
        **slurm_resources("calibrate"),
    params:
        # a search that adds an engine measures again (Snakemake reruns a job whose params changed)
        engines=CFG.calibration_engines(),
    script:
        "../../scripts/calibrate.py"


checkpoint estimate_candidates:
    # Predict memory and speed of every candidate of the search space; pick the probes.
    input:
        model=model_input,
        data=data_input,
        calibration=calibration_input,
    output:
        res("{model}/{gpu}/{method}/candidates.json"),
    log:
        logf("{model}/{gpu}/{method}/estimate_candidates.log"),
    conda:
        CONDA_ENV
    resources:
        **slurm_resources("estimate_candidates"),
    params:
        settings=estimate_settings,
    script:
        "../../scripts/estimate_candidates.py"


rule probe_candidate:
    # A few real training steps on the worst-case batch; OOM is recorded, not raised.
    input:
        candidates=res("{model}/{gpu}/{method}/candidates.json"),
        model=model_input,
        data=data_input,
    output:
        res("{model}/{gpu}/{method}/probes/{cand}.json"),
    log:
        logf("{model}/{gpu}/{method}/probes/{cand}.log"),
    benchmark:
        bench("{model}/{gpu}/{method}/probes/{cand}.tsv")
    conda:
        CONDA_ENV
    threads: rank_threads
    resources:
        **slurm_resources("probe_candidate"),
    params:
        model_path=model_dir,
        data_dir=res("{model}/data/{method}"),
    script:
        "../../scripts/probe_candidate.py"


rule select_config:
    # Fastest candidate that fits (measured beats predicted); why each other one lost.
    input:
        candidates=res("{model}/{gpu}/{method}/candidates.json"),
        probes=probe_outputs,
    output:
        selected=report(
            res("{model}/{gpu}/{method}/selected.json"),
            caption="../report/selected.rst",
            category="Selection",
        ),
        ds_config=res("{model}/{gpu}/{method}/ds_config.json"),
        run=res("{model}/{gpu}/{method}/run.json"),
        launch=res("{model}/{gpu}/{method}/launch.sh"),
        # the selected configuration for other trainers (memfit.exports.FILES)
        openrlhf=res("{model}/{gpu}/{method}/exports/openrlhf/train_{method}.sh"),
        llamafactory=res(
            "{model}/{gpu}/{method}/exports/llamafactory/train_{method}.yaml"
        ),
        llamafactory_ds=res(
            "{model}/{gpu}/{method}/exports/llamafactory/ds_config.json"
        ),
        llamafactory_dataset_info=res(
            "{model}/{gpu}/{method}/exports/llamafactory/dataset_info.json"
        ),
        hf_args=res("{model}/{gpu}/{method}/exports/hf/training_args.json"),
        hf_ds=res("{model}/{gpu}/{method}/exports/hf/ds_config.json"),
    log:
        logf("{model}/{gpu}/{method}/select_config.log"),
    conda:
        CONDA_ENV
    params:
        model_path=policy_dir,
        data_dir=res("{model}/data/{method}"),
        train_dir=res("{model}/{gpu}/{method}/train"),
        settings=train_settings,
    script:
        "../../scripts/select_config.py"
