"""memfit: fine-tune LLMs (SFT, DPO) on DeepSpeed without out-of-memory surprises.

Subpackages in the order of the DAG (ARCHITECTURE.md); imports point down this list:

- `memfit.cli`: the `memfit` command (may import anything);
- `memfit.report`: the HTML page (reads `memfit.estimate.rows`, `memfit.estimate`, `memfit.exports`);
- `memfit.workflow`: the stages the Snakefile calls (config, pipeline, probe, select, fallback,
  resume_check, slurm, demo, model_check, compare_results);
- `memfit.exports`: the selection as OpenRLHF, LLaMA-Factory and HF files;
- `memfit.estimate`: memory and time without a GPU (rooms models/, memory/, trace/, time/ under core and the CLI);
- `memfit.train`: one training or probe run on every rank (loop, steps, losses, checkpoints, launch);
- `memfit.data`: prepare_data and reading its shards;
- the vocabulary every layer shares: `memfit.space` (`Candidate`: one configuration),
  `memfit.units`, `memfit.atomic`.
"""

__version__ = "0.1.0"
