# Two entry points, both self-installing into .venv on first use:
#   make run    -> python -m rloo_jax.train on the built-in default (no network)
#   make test   -> ruff + the whole pytest suite
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1

.PHONY: run test lint install bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

run: $(VENV)/.installed
	$(BIN)/python -m rloo_jax.train $(ARGS)

lint: $(VENV)/.installed
	$(BIN)/ruff check rloo_jax tests bench notebooks scripts

test: lint
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
