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
# DeepSpeed's JIT-compiled CPU ops are built into the venv (memfit.train.launch looks there too), always
# by the venv's ninja: ninja 1.11 (Debian's) and 1.13 (the lock's) write incompatible .ninja_log
# versions, and a build by the other one recompiles every op (about a minute on 2 cores).
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch_extensions
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: demo test test-fast test-sweeps lint install ops lock upgrade docs

install: $(STAMP)

# Exactly the versions in requirements-cpu.lock (every package, transitive ones too; torch is the
# 2.13.0 CPU wheel), so a fresh clone installs what CI tested. `--no-deps`: nothing outside the lock
# comes in; `pip check` then proves the lock is complete and consistent. uv installs the lock
# (tools/uv_install.py: from wherever pip is configured to install; 18-27 s where pip took 371 s,
# docs/getting-started.md), pip when uv cannot.
$(STAMP): pyproject.toml requirements-cpu.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --no-deps "$$(grep -E '^uv==' requirements-cpu.lock)"
	$(BIN)/python tools/uv_install.py $(BIN)/python requirements-cpu.lock \
		|| $(BIN)/python -m pip install -q --no-deps -r requirements-cpu.lock
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/python -m compileall -q src  # memfit's own .pyc likewise (tools/uv_install.py)
	$(BIN)/python -m pip check
	$(MAKE) ops
	touch $@

# Where uv finds the torch CPU wheel (the CI image's local wheel folder, else PyTorch's CPU index).
TORCH_CPU_WHEELS ?= $(or $(PIP_FIND_LINKS),https://download.pytorch.org/whl/cpu/torch/)
LOCK_FLAGS := pyproject.toml --extra dev -c constraints-cpu.txt --find-links $(TORCH_CPU_WHEELS) \
	--python-version 3.11 --python-platform x86_64-manylinux_2_28 --custom-compile-command "make lock"

# Re-resolve the lock from pyproject.toml's ranges (keeping locked versions where they still
# satisfy them) and write the conda envs' pins from it.
lock: $(STAMP)
	$(BIN)/uv pip compile $(LOCK_FLAGS) -q -o requirements-cpu.lock
	$(BIN)/python tools/sync_env_pins.py

# The one command to upgrade: newest versions in range, reinstall, run the whole test suite.
upgrade: $(STAMP)
	$(BIN)/uv pip compile $(LOCK_FLAGS) -q --upgrade -o requirements-cpu.lock
	$(BIN)/python tools/sync_env_pins.py
	$(MAKE) install test

# DeepSpeed compiles its CPU ops on first use; build once here the one every CPU run loads, FusedAdam
# (the optimizer). Its shared-memory all-reduce op, which DeepSpeed would build at every process-group
# start, is skipped: only its inference uses it (memfit.train.dist.skip_shm_comm_op).
ops:
	$(BIN)/python -c "from deepspeed.ops.op_builder.cpu import FusedAdamBuilder; FusedAdamBuilder().load()"

# DeepSpeedCPUAdam, for optimizer offload only (a third of the ops' compile time, 138 of 361 CPU s):
# built for the tests, not for `make demo` (the demo does not offload). A run that offloads builds
# it at first use (torch's extension builder locks its folder: one rank builds, the others wait).
OFFLOAD_OPS := $(VENV)/.memfit-ops-offload
$(OFFLOAD_OPS): $(STAMP)
	$(BIN)/python -c "from deepspeed.ops.op_builder.cpu import CPUAdamBuilder; CPUAdamBuilder().load()"
	touch $@

demo: $(STAMP)
	$(BIN)/snakemake --cores all

# Two passes: the single-process tests (estimates, traces, reports) spread over one pytest-xdist
# worker per core, then the multi-process DeepSpeed runs (pytest marker `slow`) one at a time:
# their ranks take every core, and beside another worker's test they ran 1.45x slower
# (docs/development.md).
test: test-fast
	$(BIN)/python -m pytest -q -m slow

# Skips the multi-process DeepSpeed runs (pytest marker `slow`); `gpu` tests skip themselves without CUDA.
test-fast: $(STAMP) $(OFFLOAD_OPS)
	$(BIN)/python -m pytest -q -n auto -m "not slow"

# The sweep cases `make test` skips (pytest marker `sweep`: the other ZeRO stages and levers of a
# sweep whose representative case the slow pass runs); after a change to the trainer or estimator.
test-sweeps: $(STAMP) $(OFFLOAD_OPS)
	benchmarks/sweeps.sh

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/snakefmt --check .
	$(BIN)/snakemake --lint
	$(BIN)/python tools/check_shape.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site

# The manual (mkdocs.yml, docs/) into site/. --strict fails on a broken link or anchor; never add
# -q: mkdocs 1.6 then drops the warnings before --strict counts them, and a broken link passes.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site
