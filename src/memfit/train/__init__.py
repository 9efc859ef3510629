"""One training (or probe) run, on every rank: the `train` and `probe_candidate` stages' work.

Owns the run's configuration (`run_config`: `RunConfig`, run.json, exit codes), the loop
(`loop`: `Run.setup`, `Run.fit`, `Run.probe`), one rank's entry point (`rank`) and what it does
first to start in seconds (`startup`), starting all ranks (`launch`: the ranks of one node, torchrun across nodes, srun, signals,
threads per rank), the step of each method (`steps`, `losses`,
`vocab_loss`, `reference` for DPO), batches (`batches`), the model (`modeling`: load, LoRA,
export, QLoRA), the DeepSpeed JSON (`dsconfig`), checkpoints (`checkpoint`, `checkpoint_compat`,
`adapter_state`: QLoRA's adapter-only module state, `resume`: the loop's checkpoint hooks,
`optimizer_load` and `stream_load`: loading without a second copy, `adam_steps`, `resume_ram`: host RAM checked before a resume), ranks and collectives (`dist`) and measured memory
(`memory`). May import the top-level vocabulary (`memfit.space`, `memfit.units`,
`memfit.atomic`) and `memfit.data`; never `memfit.estimate`, `memfit.workflow`,
`memfit.exports` or `memfit.report`.
"""
