# Two entry points: `make run` (install, build a demo checkpoint, serve it over HTTP) and
# `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?= checkpoints/smollm2-135m
PRESET ?= smollm2-135m
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install install-test run test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e .

install-test: $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,cluster]'

$(MODEL)/config.json: | install
	$(BIN)/kvserve make-model $(PRESET) --output $(MODEL)

run: install $(MODEL)/config.json
	$(BIN)/kvserve serve $(MODEL) --served-model-name $(PRESET) --host $(HOST) --port $(PORT)

# One pytest worker per core (most tests run single-threaded Python), each test file on one
# worker so that its fixtures are built once.
test: install-test
	$(BIN)/ruff check src tests
	PYTHONUNBUFFERED=1 $(BIN)/python -m pytest -q tests -n auto --maxprocesses 4 --dist loadfile

lint: install-test
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) checkpoints .pytest_cache
