# Two commands on a fresh machine: `make up` starts the stack, `make test` runs the tests.
# Each first installs everything into .venv (Python 3.11 or 3.12).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install up test test-slow lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(BIN)/halfmoon up $(ARGS)

test: $(STAMP)
	$(BIN)/halfmoon model pull
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The e2e and integration suites on a machine about three times slower than a fast one:
# SLOW_CPUS CPUs' worth of time for the whole run (a cgroup CPU quota; root), on the AVX2
# code path. Every time bound, load and SLO in them must hold there (see README, Tests).
SLOW_CPUS ?= 0.6
# Like .ci/run, it first installs the console browser test's Chromium and playwright-core
# (only what is missing), so that test runs rather than skips.
test-slow: $(STAMP)
	bash scripts/install-browser.sh
	$(BIN)/halfmoon model pull
	HALFMOON_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
	  scripts/slow-machine --cpus $(SLOW_CPUS) $(BIN)/python -m pytest tests/e2e tests/integration $(PYTEST_ARGS)

# Lint and format check on the whole tree, strict types on the pure core (pyproject.toml).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache
