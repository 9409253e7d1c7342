PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
GPU_COMPILE_VENV ?= .venv-gpu-compile
GPU_COMPILE_BIN := $(GPU_COMPILE_VENV)/bin
MODEL ?= smollm2
PORT ?= 8000

.PHONY: install install-test install-gpu-compile serve test generate bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

## Installs (editable) only when pyproject.toml changed since the last install.
install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	@touch $@

## Test extras and, for the web UI's browser tests, Debian's chromium with its chromedriver, and
## for the metrics test (tests/test_metrics_prometheus.py) Debian's prometheus with promtool
## (installed when missing).
install-test: $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	@command -v chromium >/dev/null && test -x /usr/bin/chromedriver || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	else echo "note: no chromium + chromedriver, the browser tests will skip (apt-get install chromium chromium-driver)"; fi
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; \
	else echo "note: no prometheus + promtool, the Prometheus metrics test will skip (apt-get install prometheus)"; fi

$(GPU_COMPILE_BIN)/python:
	$(PYTHON) -m venv $(GPU_COMPILE_VENV)
	$(GPU_COMPILE_BIN)/pip install -q --upgrade pip

## The GPU compile check in an environment of its own: jax's CUDA plugin (with ptxas) stays out of
## $(VENV), where it would print "Could not find cuda drivers" at every start on a CPU machine.
install-gpu-compile: $(GPU_COMPILE_BIN)/python
	$(GPU_COMPILE_BIN)/pip install -q -e '.[gpu-compile]' pytest

## Install, fetch + convert the default model on first use, and serve it on 127.0.0.1:$(PORT).
serve: install
	$(BIN)/jaxserve serve --model=$(MODEL) --port=$(PORT)

## Install with the test extras and run the whole suite; then the GPU compile check (its tests
## skip in the first run) in its own environment.
test: install-test install-gpu-compile
	$(BIN)/python -m pytest -q --durations=25 tests
	$(GPU_COMPILE_BIN)/python -m pytest -q tests/test_gpu_compile.py tests/test_kernel_gpu_compile.py

generate: install
	$(BIN)/jaxserve generate --model=$(MODEL) --input=$(INPUT) --output=$(OUTPUT)
