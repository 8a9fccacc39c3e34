# `make test` and `make serve` each set everything up first: a fresh machine needs only Python 3.11.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test serve lint bench clean

PLUGINS := plugins/fullhash plugins/fileinfo plugins/filename

$(STAMP): pyproject.toml $(PLUGINS:%=%/pyproject.toml)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]' $(PLUGINS:%=-e %)
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check metanode plugins tests tools
	$(BIN)/mypy

serve: $(STAMP)
	$(BIN)/metanode serve

bench: $(STAMP)
	$(BIN)/python tools/bench/core.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
