# `make test` and `make serve` each set everything up first: a fresh machine needs only Python 3.11.
# `make serve` installs only what serving needs (the package and its plugins); `make test` adds
# the test tools to the same .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SERVE_STAMP := $(VENV)/.serve-installed
TEST_STAMP := $(VENV)/.test-installed

.PHONY: test serve lint bench clean postgresql

PLUGINS := plugins/fullhash plugins/fileinfo plugins/filename plugins/mediainfo plugins/nfo

# setuptools warns at every editable install that a folder named as the package may shadow it
# (a UserWarning, six times over on a fresh machine, that reads like a failure): not shown.
QUIET_BUILD := PYTHONWARNINGS=ignore::UserWarning

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(SERVE_STAMP): pyproject.toml $(PLUGINS:%=%/pyproject.toml) | $(BIN)/python
	$(QUIET_BUILD) $(BIN)/python -m pip install --quiet -e . $(PLUGINS:%=-e %)
	touch $(SERVE_STAMP)

# The PostgreSQL driver (an extra), for `METANODE_STORAGE=postgresql://… make serve`
# (docs/scale-out.md); the embedded SQLite default never needs it.
PG_STAMP := $(VENV)/.postgresql-installed
SERVE_NEEDS := $(SERVE_STAMP) $(if $(findstring postgres,$(METANODE_STORAGE)),$(PG_STAMP))

$(PG_STAMP): pyproject.toml | $(SERVE_STAMP)
	$(QUIET_BUILD) $(BIN)/python -m pip install --quiet -e '.[postgresql]'
	touch $(PG_STAMP)

$(TEST_STAMP): $(SERVE_STAMP)
	$(QUIET_BUILD) $(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(TEST_STAMP)

test: $(TEST_STAMP)
	$(BIN)/python -m pytest

lint: $(TEST_STAMP)
	$(BIN)/ruff check metanode plugins tests tools
	$(BIN)/ruff format --check metanode plugins tests tools
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/vulture

# two malloc arenas: ≈ 40 % less resident memory (docs/operations.md, "Running for months")
serve: $(SERVE_NEEDS)
	MALLOC_ARENA_MAX=$${MALLOC_ARENA_MAX:-2} $(BIN)/metanode serve

postgresql: $(PG_STAMP)

bench: $(TEST_STAMP)
	$(BIN)/python tools/bench/core.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
