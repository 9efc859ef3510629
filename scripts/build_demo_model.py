"""Snakemake script: build_demo_model -> memfit.workflow.demo.build_demo_model."""

from pathlib import Path

from memfit.workflow.demo import build_demo_model
from memfit.workflow.pipeline import log_to

log_to(snakemake.log[0])
build_demo_model(snakemake.input.config, Path(snakemake.input.sft).parent, snakemake.output[0])
