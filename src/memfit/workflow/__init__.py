"""The workflow's stages, as the Snakefile calls them (scripts/*.py -> `pipeline`), and what they
decide with.

Owns the user's config (`config`: `WorkflowConfig`, validated once), the stage functions
(`pipeline`: prepare_data, estimate_candidates, probe_candidate, select_config, train;
`none_fits` when nothing fits), building the demo model (`demo`), checking a model directory
(`model_check`), probing (`probe`), selecting (`pipeline.select_config` over `memfit.estimate.selection`), the OOM fallback during `train` (`fallback`), the resume check (`resume_check`),
SLURM resources per rule (`slurm`) and comparing two results trees (`compare_results`). May
import everything below it: `memfit.estimate`, `memfit.train`, `memfit.data`, `memfit.exports`
and the top-level vocabulary; never `memfit.report` or `memfit.cli`.
"""
