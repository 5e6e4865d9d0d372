# Two commands on a fresh machine: `make up` starts the stack, `make test` runs the tests.
# Each first installs everything into .venv (Python 3.11 or 3.12).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install up test lint clean

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

# Lint and format check on the whole tree, strict types on the pure core (pyproject.toml).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache
