# `make run` and `make test` work on a fresh machine: each creates .venv and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; override for CUDA machines (e.g. TORCH_SPEC='torch>=2.11,<2.14').
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= It is a truth universally acknowledged, that
PYTEST_ARGS ?=
# Test modules spread over this many processes (pytest-xdist; a module's tests stay in one, with its server).
PYTEST_WORKERS ?= 2

.PHONY: run test test-gpu clean

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# The web page test drives Debian's chromium through Selenium. Installed here when missing and apt-get
# can (as root); otherwise that test skips, or fails under CI=true, saying why.
$(VENV)/.browser:
	@mkdir -p $(@D); if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then touch $@; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  echo "make: installing chromium and chromium-driver (apt-get) for the web page test"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  { apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && \
	      apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null 2>&1; }; } && \
	  touch $@ || echo "make: could not install chromium; the web page test will skip (and fail under CI=true)"; \
	else echo "make: no chromium and no apt-get as root to install it; the web page test will skip (and fail under CI=true)"; fi

run: $(VENV)/.base
	$(VENV)/bin/strata generate --prompt "$(PROMPT)" --max-tokens 64

test: $(VENV)/.test $(VENV)/.browser
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-gpu: $(VENV)/.test
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .cache .pytest_cache
