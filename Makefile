# Two commands do all the set-up on a fresh machine:
#   make quickstart   create .venv, install torch first, install diffrl (no extras), train the embedded default
#   make test         the same, plus the test tools (`.[test]`: pytest, Ray, Playwright, moto...), then lint (ruff,
#                     import layers) and the whole test suite
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
# --no-compile: pip would byte-compile every installed module (torch, mlflow, prefect...) up front, most of the
# install's time on a 2-core machine; Python compiles the modules a command imports on first use instead
PIP     = $(PY) -m pip
PIP_INSTALL = $(PIP) install -q --no-compile
TORCH  ?= torch==2.13.0
# pytest-xdist workers for `make test` (the CI machine has 2 cores; each worker holds tiny models and servers: keep it
# small); 1 runs the suite in one process. Ray and vLLM tests stay on one worker each (tests/conftest.py).
# --durations prints the slowest tests, to keep the suite under CI's 25 minutes.
TEST_WORKERS ?= 2

.PHONY: venv install install-test quickstart lint browser test test-fast clean

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(VENV)/bin/activate pyproject.toml
	$(PIP) install -q --upgrade pip
	# torch first: a CPU build when one is on the machine; the range in pyproject keeps it
	$(PIP_INSTALL) "$(TORCH)" || $(PIP_INSTALL) "torch>=2.5,<2.14"
	$(PIP_INSTALL) -e .
	touch $@

# the test tools on top of the lean install (pyproject's [test] extra, which includes Ray)
$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP_INSTALL) -e ".[test]"
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

quickstart: install
	$(VENV)/bin/diffrl train

# the habits of docs/architecture.md: ruff (lint + format) and the import layers (pyproject's importlinter contracts)
lint: install-test
	$(VENV)/bin/ruff check diffrl tests benchmarks
	$(VENV)/bin/ruff format --check diffrl tests benchmarks
	$(VENV)/bin/lint-imports --no-cache

# the browser test (tests/e2e/test_mlflow_ui_browser.py) drives Debian's chromium; Playwright's own browser download
# needs the internet. Installed when missing and root; otherwise that test is skipped with its reason.
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  if [ "$$(id -u)" = 0 ]; then (apt-get update -q && apt-get install -y -q chromium) || \
	    echo "could not install chromium: the browser test is skipped"; \
	  else echo "chromium is missing and this is not root: apt-get install chromium (the browser test is skipped)"; fi

test: lint browser
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadgroup --durations=40

test-fast: install-test
	$(PY) -m pytest tests -m "not slow"

# what `diffrl train` and `diffrl ui` leave in the folder: runs/ (the runs' data), mlflow.db (MLflow's tracking
# store), mlruns/ (MLflow's artifacts: images, config.yaml, logged models), mlartifacts/ (artifacts logged through
# a `diffrl ui` server)
clean:
	rm -rf $(VENV) runs mlflow.db mlruns mlartifacts .diffrl_cache
