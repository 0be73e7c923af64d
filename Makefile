# Two commands do all the set-up on a fresh machine:
#   make quickstart   create .venv, install torch first, install diffrl, train the embedded default
#   make test         the same set-up, then lint (ruff, import layers) and the whole test suite
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
TORCH  ?= torch==2.13.0

.PHONY: venv install quickstart lint test test-fast clean

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(VENV)/bin/activate pyproject.toml
	$(PIP) install -q --upgrade pip
	# torch first: a CPU build when one is on the machine; the range in pyproject keeps it
	$(PIP) install -q "$(TORCH)" || $(PIP) install -q "torch>=2.5,<2.14"
	$(PIP) install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

quickstart: install
	$(VENV)/bin/diffrl train

# the habits of docs/architecture.md: ruff (lint + format) and the import layers (pyproject's importlinter contracts)
lint: install
	$(VENV)/bin/ruff check diffrl tests benchmarks
	$(VENV)/bin/ruff format --check diffrl tests benchmarks
	$(VENV)/bin/lint-imports --no-cache

# Two test files at a time (pytest-xdist, one worker a core; a file's tests and its module fixtures, such as a vLLM
# server, stay on one worker): most tests wait on subprocesses and servers and used ~1.2 of the 2 cores one at a
# time. One torch thread a process: two processes spinning two OpenMP threads each on 2 cores ran tiny models many
# times slower.
PYTEST_PARALLEL ?= -n 2 --dist loadfile
test: lint
	OMP_NUM_THREADS=1 $(PY) -m pytest tests $(PYTEST_PARALLEL)

test-fast: install
	$(PY) -m pytest tests -m "not slow"

clean:
	rm -rf $(VENV) runs mlflow.db mlartifacts .diffrl_cache
