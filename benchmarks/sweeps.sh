#!/usr/bin/env bash
# The sweeps the test suite keeps one representative case of (pytest marker `sweep`): the other
# ZeRO stages, methods and levers of the real 2-rank DeepSpeed runs on the CPU accelerator.
# `make test` skips them (each skip names this script) to keep its slow pass short; run them after
# a change to the trainer, the estimator's ZeRO or QLoRA terms, or sequence parallelism:
#
#   benchmarks/sweeps.sh                         # every sweep case (11; about 10 min on 2 idle cores)
#   benchmarks/sweeps.sh tests/test_train.py     # those of one file
#
# Arguments go to pytest (files, -k, --collect-only); without files, every test file. Exit status: pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q --sweeps -m sweep "$@"
