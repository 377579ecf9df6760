# The two commands of the README. Both work from a fresh clone: they create .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test install install-test lint clean

# A strict editable install links each source file into the `hotpool` package layout
# (see pyproject.toml); it is re-run only when pyproject.toml or the set of files changed.
install: $(BIN)/python
	@$(BIN)/python build_backend/install_if_changed.py $(VENV)

install-test: $(BIN)/python
	@$(BIN)/python build_backend/install_if_changed.py $(VENV) test

$(BIN)/python:
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "hotpool needs Python >= 3.11"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

## make run: set up, pull SmolLM2, serve it as deployment `smollm2` on http://127.0.0.1:8000
run: install
	$(BIN)/hotpool models pull smollm2 --if-missing
	$(BIN)/hotpool serve --deploy smollm2

## make test: set up and run the whole test suite
test: install-test
	$(BIN)/ruff check .
	$(BIN)/python -m pytest --durations=30

lint: install-test
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) build .cache .pytest_cache .ruff_cache
