# Two entry points, both self-installing into .venv on first use:
#   make run    -> python -m rloo_jax.train on the built-in default (needs no network); installs the package only
#                  (EXTRAS=tpu on a TPU VM, EXTRAS=cuda on a GPU node)
#   make test   -> ruff + the whole pytest suite; adds the test extra (CPU torch, TRL, peft, libtpu, ...)
#   make test-accelerator -> the suite on this machine's GPU or TPU (EXTRAS=cuda on a GPU node)
#   make lock   -> re-resolve the test environment (newest releases within pyproject.toml's bounds) into constraints.txt
# Both installs take their versions from constraints.txt, the lock: every package of the test environment at a version
# the whole suite passed on, so a release elsewhere (TRL, transformers, ruff, ...) cannot break or pass CI unseen.
# `make run` installs the package's own dependencies only (at the locked versions), so a missing base dependency or a
# top-level import of a test-only package fails it. Without make, `pip install -e .` resolves freely within
# pyproject.toml's bounds; `pip install -c constraints.txt -e .` installs the tested versions.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
EXTRAS ?=
LOCK    = constraints.txt
# the tests never reach the hub (tiny models are built locally); `make run` may (a hub id in ARGS downloads)
OFFLINE = HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1

.PHONY: run test test-accelerator lint install install-test lock bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c $(LOCK) --upgrade pip

$(VENV)/.installed: pyproject.toml $(LOCK) | $(BIN)/python
	$(BIN)/pip install -q -c $(LOCK) -e ".$(if $(EXTRAS),[$(EXTRAS)])"
	touch $@

# CPU torch first, from the wheel on disk: a bare `torch` requirement would pull GBs of CUDA packages
$(VENV)/.installed-test: pyproject.toml $(LOCK) | $(BIN)/python
	$(BIN)/pip install -q -c $(LOCK) "torch==2.13.0"
	$(BIN)/pip install -q -c $(LOCK) -e ".[test]"
	$(BIN)/pip install -q --no-deps --upgrade --target .venv-trl112 "trl==1.12.0"  # TRL's last PPOTrainer, for parity tests in a subprocess
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

run: $(VENV)/.installed
	$(BIN)/python -m rloo_jax.train $(ARGS)

lint: $(VENV)/.installed-test
	$(BIN)/ruff check rloo_jax tests bench notebooks scripts examples

# JAX_PLATFORMS=cpu: libtpu (test extra) is installed, but tests run on the CPU and compile for TPUs ahead of time.
# Two workers, each taking whole test files (their module fixtures build once), longest first by tests/file_seconds.txt
# (tests/suite_checks.py); PYTEST_WORKERS=0 runs serially. The
# whole suite (no PYTEST_ARGS) fails unless the tests that skip are exactly tests/expected_skips.txt
# (tests/suite_checks.py). The 25 slowest tests and 10 slowest files are listed at the end (the suite takes 40-65
# minutes on the 2-core machine, by its load, BENCHMARKS.md Sessions 14-15 and 18; issue 36 asks for 15).
PYTEST_WORKERS ?= 2
PYTEST = $(OFFLINE) JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile \
	--file-seconds tests/file_seconds.txt \
	--durations 25 --durations-by-file 10
test: lint
	$(PYTEST) $(if $(PYTEST_ARGS),,--expect-skips tests/expected_skips.txt) $(PYTEST_ARGS)

# The suite on the accelerator JAX finds (JAX_PLATFORMS empty): float32 tests compute at `highest` matmul precision
# and XLA's deterministic GPU ops are on (tests/conftest.py); tests marked cpu_only are skipped, each with its reason;
# GPU memory is allocated as needed, not preallocated. docs/numerics.md.
test-accelerator: $(VENV)/.installed-test
	$(if $(EXTRAS),$(BIN)/pip install -q -c $(LOCK) -e ".[$(EXTRAS)]")
	JAX_PLATFORMS= XLA_PYTHON_CLIENT_PREALLOCATE=false $(BIN)/python -m pytest -q -rs $(PYTEST_ARGS)

# The lock, refreshed: a fresh venv resolves the test extra from pyproject.toml alone (the newest releases its bounds
# allow; CPU torch as above) and its versions become constraints.txt. Then `make test` on it (and raise the lower
# bounds in pyproject.toml that tests/test_packaging.py names) before committing it: a lock is known-good once the
# suite has passed on it.
LOCK_VENV = .venv-lock
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install -q --upgrade pip
	$(LOCK_VENV)/bin/pip install -q "torch==2.13.0"
	$(LOCK_VENV)/bin/pip install -q -e ".[test]"
	{ printf '%s\n' "# The test environment's lock (make lock; see the Makefile): pip install -c constraints.txt ..." \
	    "# Resolved with Python $$($(LOCK_VENV)/bin/python -c 'import platform; print(platform.python_version(), platform.system(), platform.machine())')." \
	    "pip==$$($(LOCK_VENV)/bin/python -m pip --version | cut -d' ' -f2)"; \
	  $(LOCK_VENV)/bin/pip freeze --exclude-editable | sed -e 's/+cpu$$//'; } > $(LOCK)
	rm -rf $(LOCK_VENV)

clean:
	rm -rf $(VENV) .pytest_cache
