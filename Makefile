# Two entry points, both self-installing into .venv on first use:
#   make run    -> python -m rloo_jax.train on the built-in default (needs no network); installs the package only
#                  (EXTRAS=tpu on a TPU VM, EXTRAS=cuda on a GPU node)
#   make test   -> ruff + the whole pytest suite; adds the test extra (CPU torch, TRL, peft, libtpu, ...)
#   make test-accelerator -> the suite on this machine's GPU or TPU (EXTRAS=cuda on a GPU node)
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
EXTRAS ?=
# the tests never reach the hub (tiny models are built locally); `make run` may (a hub id in ARGS downloads)
OFFLINE = HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1

.PHONY: run test test-accelerator lint install install-test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".$(if $(EXTRAS),[$(EXTRAS)])"
	touch $@

# CPU torch first, from the wheel on disk: a bare `torch` requirement would pull GBs of CUDA packages
$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps --upgrade --target .venv-trl112 "trl==1.12.0"  # TRL's last PPOTrainer, for parity tests in a subprocess
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

run: $(VENV)/.installed
	$(BIN)/python -m rloo_jax.train $(ARGS)

lint: $(VENV)/.installed-test
	$(BIN)/ruff check rloo_jax tests bench notebooks scripts

# JAX_PLATFORMS=cpu: libtpu (test extra) is installed, but tests run on the CPU and compile for TPUs ahead of time.
# Two workers, each taking whole test files (their module fixtures build once); PYTEST_WORKERS=0 runs serially; the
# 15 slowest tests are listed at the end (CI's budget: well under 25 minutes on the 2-core machine).
PYTEST_WORKERS ?= 2
test: lint
	$(OFFLINE) JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations 15 $(PYTEST_ARGS)

# The suite on the accelerator JAX finds (JAX_PLATFORMS empty): float32 tests compute at `highest` matmul precision
# and XLA's deterministic GPU ops are on (tests/conftest.py); tests marked cpu_only are skipped, each with its reason;
# GPU memory is allocated as needed, not preallocated. docs/numerics.md.
test-accelerator: $(VENV)/.installed-test
	$(if $(EXTRAS),$(BIN)/pip install -q -e ".[$(EXTRAS)]")
	JAX_PLATFORMS= XLA_PYTHON_CLIENT_PREALLOCATE=false $(BIN)/python -m pytest -q -rs $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
