"""The cards the estimator reads: what a model and a GPU are, before any memory or time.

Owns the model architecture card (`arch`: `ModelArch`; `arch_to_hf`: it as a transformers
config), the model and GPU catalogs (`catalog`, config/models.yaml and config/gpus.yaml),
config.json parsing (`hf_config`, `config_fields`, `hf_layouts`: ChatGLM's and Gemma-3's own
layouts), the layout transformers itself builds (`inventory` on fake tensors from `fake_mode`,
`generic` for a model without a hand-written card, `layer_counts`: LoRA and gradient-free
parameters counted on it), whether a model directory's weights match its config
(`checkpoint_check`), the parameter layout and LoRA targets (`params`), what a card or a GPU
cannot run (`validity`), the local GPU (`detect`) and each GPU's measured calibration file
(`calibration`: config/calibration/<gpu>.json, the device terms and kernel rates memory/ and
time/ read). The lowest room: may import only the estimator's vocabulary
(`memfit.estimate.settings`, `memfit.estimate.errors`), the top-level vocabulary
(`memfit.space`, `memfit.units`, ...) and the trainer's LoRA configuration
(`memfit.train.lora`); never memory/, trace/, time/ or the modules above them.
"""
