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

## Test extras, the GPU compile check (jax's CUDA plugin + ptxas) and, for the web UI's browser
## tests, Debian's chromium with its chromedriver (installed when missing).
install-test: $(BIN)/python
	$(BIN)/pip install -q -e '.[test,gpu-compile]'
	@command -v chromium >/dev/null && test -x /usr/bin/chromedriver || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	else echo "note: no chromium + chromedriver, the browser tests will skip (apt-get install chromium chromium-driver)"; fi

## Install, fetch + convert the default model on first use, and serve it on 127.0.0.1:$(PORT).
serve: install
	$(BIN)/jaxserve serve --model=$(MODEL) --port=$(PORT)

## Install with the test extras and run the whole suite.
test: install-test
	$(BIN)/python -m pytest -q tests

generate: install
	$(BIN)/jaxserve generate --model=$(MODEL) --input=$(INPUT) --output=$(OUTPUT)
