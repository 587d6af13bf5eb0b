# Two entry points: `make run` (install, build a demo checkpoint, generate) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?= checkpoints/smollm2-135m
PRESET ?= smollm2-135m

.PHONY: install install-test run test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e .

install-test: $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'

$(MODEL)/config.json: | install
	$(BIN)/kvserve make-model $(PRESET) --output $(MODEL)

run: install $(MODEL)/config.json
	$(BIN)/kvserve generate --model $(MODEL) --max-tokens 32 \
		--prompt "def fibonacci(n):" \
		--prompt "import os" \
		--prompt "class Request:" \
		--prompt "The quick brown fox"

test: install-test
	$(BIN)/ruff check src tests
	$(BIN)/python -m pytest -q tests

lint: install-test
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) checkpoints .pytest_cache
