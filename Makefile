# `make run` and `make test` work on a fresh machine: each creates .venv and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; override for CUDA machines (e.g. TORCH_SPEC='torch>=2.11,<2.14').
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= It is a truth universally acknowledged, that
PYTEST_ARGS ?=

.PHONY: run test test-gpu clean

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PY) -m pip install -q -e '.[test]'
	touch $@

run: $(VENV)/.base
	$(VENV)/bin/strata generate --prompt "$(PROMPT)" --max-tokens 64

test: $(VENV)/.test
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-gpu: $(VENV)/.test
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .cache .pytest_cache
