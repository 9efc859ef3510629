# Two commands a newcomer needs (see README):
#   make demo   set up .venv and run the whole DAG on the embedded CPU default
#   make test   set up .venv and run the whole test suite (test-fast: without the slow multi-process runs)
# Everything else here is a step of those two.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.memfit-installed

export DS_ACCELERATOR ?= cpu
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# DeepSpeed's JIT-compiled CPU ops are built into the venv (memfit.launch looks there too).
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch_extensions

.PHONY: demo test test-fast lint install ops

install: $(STAMP)

# torch==2.13.0 (a CPU wheel) through constraints-cpu.txt; a bare torch would pull CUDA.
$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints-cpu.txt -e '.[dev]'
	$(MAKE) ops
	touch $@

# DeepSpeed compiles its CPU ops (CPU-Adam, shared-memory comm) on first use; two ranks
# compiling at once race, so build them once here.
ops:
	$(BIN)/python -c "from deepspeed.ops.op_builder.cpu import CPUAdamBuilder, ShareMemCommBuilder, FusedAdamBuilder; [b().load() for b in (CPUAdamBuilder, ShareMemCommBuilder, FusedAdamBuilder)]"

demo: $(STAMP)
	$(BIN)/snakemake --cores all

test: $(STAMP)
	$(BIN)/python -m pytest -q

# Skips the multi-process DeepSpeed runs (pytest marker `slow`); `gpu` tests skip themselves without CUDA.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/snakefmt --check .
	$(BIN)/snakemake --lint
	$(BIN)/python tools/check_shape.py
