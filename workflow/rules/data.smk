rule build_demo_model:
    input:
        config=build_config,
        sft=config["data"].get("sft", []),
        dpo=config["data"].get("dpo", []),
    output:
        directory("resources/{model}"),
    log:
        logf("{model}/build_demo_model.log"),
    # Only for models whose config entry has `build:` (the embedded demo): a random-init
    # model from a HF config, with a tokenizer trained on the bundled data.
    wildcard_constraints:
        model=BUILT_MODELS,
    conda:
        CONDA_ENV
    resources:
        **slurm_resources("build_demo_model"),
    script:
        "../../scripts/build_demo_model.py"


rule prepare_data:
    input:
        model=model_input,
        source=data_source,
    output:
        train=res("{model}/data/{method}/train.parquet"),
        eval=res("{model}/data/{method}/eval.parquet"),
        stats=res("{model}/data/{method}/stats.json"),
    log:
        logf("{model}/data/{method}/prepare_data.log"),
    benchmark:
        bench("{model}/data/{method}/prepare_data.tsv")
    conda:
        CONDA_ENV
    resources:
        **slurm_resources("prepare_data"),
    params:
        tokenizer=model_dir,
        max_len=config["data"]["max_len"],
        eval_fraction=config["data"].get("eval_fraction", 0.05),
        seed=config["data"].get("seed", 0),
        assistant_loss=config["data"].get("assistant_loss", "all"),
    script:
        "../../scripts/prepare_data.py"
