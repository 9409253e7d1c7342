PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?= smollm2
PORT ?= 8000

.PHONY: install install-test serve test generate bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -q -e .

install-test: $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'

## Install, fetch + convert the default model on first use, and serve it on 127.0.0.1:$(PORT).
serve: install
	$(BIN)/jaxserve serve --model=$(MODEL) --port=$(PORT)

## Install with the test extras and run the whole suite.
test: install-test
	$(BIN)/python -m pytest -q tests

generate: install
	$(BIN)/jaxserve generate --model=$(MODEL) --input=$(INPUT) --output=$(OUTPUT)
