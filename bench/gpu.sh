#!/usr/bin/env bash
# The GPU benchmark: random bf16 models shaped like Llama 3.2 1B and Llama 3.1 8B, both
# servers on each (one start per server: an 8B load takes a while), results under
# OUT/<shape>/ (no plots: `python -m bench.report OUT/<shape>/results.json` draws them
# where matplotlib is installed). The decode batch takes 64 streams in both servers.
#   bash bench/gpu.sh OUT [shape ...]      # default shapes: llama-1b llama-8b
#   BENCH_TOKENIZER=MODEL_DIR bash bench/gpu.sh OUT ...
# With BENCH_TOKENIZER the shapes use that model directory's tokenizer (a real vocabulary,
# e.g. the default model's converted directory: SmolLM2's 49k) and are named
# <shape>-vocab<N>; BENCH_WORKLOADS picks workloads (default: all); BENCH_ARGS adds flags to
# each shape's `python -m bench` (e.g. --no-structured). snapshot_models (tiny
# sliding-window and hybrid demo models, whatever the shape) runs once, into OUT/snapshot-models/.
# With single_stream, each shape's decode parity (bench/decode_parity.py) goes to
# OUT/<shape>-decode-parity/. BENCH_LLAMA_SERVER=PATH (llama.cpp's `llama-server`, built
# with CUDA) adds llama.cpp as a third server, on the shape exported to a bf16 GGUF
# (bench/gguf_export.py), with bench/servers.py's GPU flags (64 slots, --cache-reuse).
#
# Scale-out on a machine with N GPUs (docs/scale-out.md), default shape llama-8b:
#   bash bench/gpu.sh --scale-out OUT [shape ...]
# one radix-mlx server on one GPU against (a) the same model sharded over the N GPUs with
# --tensor-parallel N (NCCL), on single-stream decode, cold long-context prefill and batch
# decode, and bare mlx-lm sharded N ways on single-stream decode; and (b) N replicas, a GPU
# each, behind sglang-router (cache-aware, then round-robin), on the shared-prefix (SGLang's
# 64 groups x 16 prompts) and multi-turn workloads, 64 requests at once per GPU, so that
# every engine's batch of 64 stays full (one server queues the rest). BENCH_WORKLOADS picks
# some of these. BENCH_QUICK=1 runs it with toy sizes on the demo model (any machine, the
# CPU included) to check the path end to end.
#
# Images in multi-turn conversations (issue 31), radix-mlx against mlx_vlm.server
# (bench/vision.py), on a random bf16 Gemma 3 vision model of Gemma 3 4B's shape
# (`make-demo-model --family gemma3-vision --size 4b`), built under BENCH_MODELS_DIR:
#   bash bench/gpu.sh --vision OUT        # results under OUT/vision-4b/
# It needs mlx-vlm and what it imports beside this project's own packages: the wheels
# bench/stage_vision_wheels.sh gathers (its header says how to install them). BENCH_QUICK=1
# runs it on the tiny demo size with 2 conversations of 2 turns (any machine).
set -euo pipefail
scale_out=
vision=
if [ "${1:-}" = --scale-out ]; then scale_out=1; shift; fi
if [ "${1:-}" = --vision ]; then vision=1; shift; fi
out=${1:?usage: bench/gpu.sh [--scale-out | --vision] OUT [shape ...]}
shift
models=${BENCH_MODELS_DIR:-/tmp/bench-models}
# With BENCH_KEEP_MODELS a later call reuses a shape's model and GGUF (the weights are
# seeded, so they are the same): drawing and exporting an 8B takes minutes of a lease.
# A file is reused only once its `.done` marker says it was written whole.
made() { [ -n "${BENCH_KEEP_MODELS:-}" ] && [ -f "$1.done" ]; }
draw_model() {
  made "$models/$1" && return
  python3 -m bench.models "$models/$1" --shape "$2" --dtype bfloat16 "${tokenizer[@]}"
  touch "$models/$1.done"
}
if [ -n "$vision" ]; then
  mkdir -p "$out"
  if [ -n "${BENCH_QUICK:-}" ]; then
    python3 -m bench.vision --size tiny --conversations 2 --turns 2 --max-tokens 8 \
      --models-dir "$models" --out "$out/vision-tiny"
    exit
  fi
  nvidia-smi > "$out/nvidia-smi.txt"
  python3 -m bench.vision --size 4b --models-dir "$models" --out "$out/vision-4b"
  exit
fi
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(llama-1b llama-8b)
tokenizer=()
suffix=
if [ -n "${BENCH_TOKENIZER:-}" ]; then
  tokenizer=(--tokenizer-from "$BENCH_TOKENIZER")
  suffix=-vocab$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["vocab_size"])' \
    "$BENCH_TOKENIZER/config.json")
fi
wanted=${BENCH_WORKLOADS:-$(python3 -c 'from bench.__main__ import all_workloads; print(",".join(all_workloads()))')}
per_shape=$(tr , '\n' <<< "$wanted" | grep -vx snapshot_models | paste -sd, -)
sizes=(--sp-groups 8 --sp-prompts-per-group 4 --sp-system-tokens 2000
  --sp-question-tokens 64 --sp-output-tokens 64 --sp-concurrency 16
  --mt-conversations 8 --mt-turns 4 --mt-system-tokens 1000 --mt-user-tokens 200
  --mt-output-tokens 64)
mkdir -p "$out"
if [ -n "$scale_out" ]; then
  gpus=2
  [ -n "${BENCH_QUICK:-}" ] || gpus=$(nvidia-smi -L | wc -l)
  scale_flags=(--servers radix-mlx --tensor-parallel "$gpus" --replicas "$gpus" --no-plots
    --no-structured --no-restart-per-workload
    --workloads "${BENCH_WORKLOADS:-single_stream,long_context,batch_decode,shared_prefix,multi_turn}")
  if [ -n "${BENCH_QUICK:-}" ]; then
    python3 -m server.launch.cli make-demo-model "$models/tiny" > /dev/null
    python3 -m bench --quick --model "$models/tiny" --out "$out/quick-scale-out" \
      "${scale_flags[@]}" --lc-document-tokens 256 --decode-output-tokens 16 \
      --decode-repeats 1 --sp-groups 2 --sp-prompts-per-group 2 --mt-conversations 2 \
      --mt-turns 2 --bd-streams 4 --bd-output-tokens 16
    exit
  fi
  nvidia-smi > "$out/nvidia-smi.txt"
  [ $# -gt 0 ] || shapes=(llama-8b)
  for s in "${shapes[@]}"; do
    name=$s$suffix
    draw_model "$name" "$s"
    python3 -m bench --model "$models/$name" --out "$out/$name-scale-out" \
      "${scale_flags[@]}" --replicas-cuda-devices "$(seq -s, 0 $((gpus - 1)))" \
      --radix-mlx-args "--max-batch-size 64" "${sizes[@]}" --sp-groups 64 \
      --sp-prompts-per-group 16 --sp-concurrency $((64 * gpus)) \
      --mt-conversations $((64 * gpus)) \
      --lc-document-tokens 6000 --lc-questions 4 --lc-question-tokens 64 \
      --lc-output-tokens 32 --decode-output-tokens 128 --decode-repeats 2 \
      --bd-streams 64 --bd-prompt-tokens 64 --bd-output-tokens 128
    [ -n "${BENCH_KEEP_MODELS:-}" ] || rm -rf "${models:?}/$name" "${models:?}/$name.done"
  done
  exit
fi
nvidia-smi > "$out/nvidia-smi.txt"
for s in "${shapes[@]}"; do
  [ -n "$per_shape" ] || break
  name=$s$suffix
  draw_model "$name" "$s"
  peer=()
  if [ -n "${BENCH_LLAMA_SERVER:-}" ]; then
    if ! made "$models/$name.gguf"; then
      python3 -m bench.gguf_export "$models/$name" "$models/$name.gguf" --dtype bfloat16
      touch "$models/$name.gguf.done"
    fi
    peer=(--servers radix-mlx,mlx-lm,llama-cpp --llama-server "$BENCH_LLAMA_SERVER"
      --llama-cpp-gguf "$models/$name.gguf")
  fi
  python3 -m bench --model "$models/$name" --out "$out/$name" --no-plots "${peer[@]}" \
    --no-restart-per-workload --workloads "$per_shape" \
    --radix-mlx-args "--max-batch-size 64" --mlx-lm-args "--decode-concurrency 64" \
    "${sizes[@]}" --ns-prompts 32 --ns-prompt-tokens 1000 --ns-output-tokens 64 \
    --ns-concurrency 16 --lc-document-tokens 6000 --lc-questions 4 \
    --lc-question-tokens 64 --lc-output-tokens 32 --decode-output-tokens 128 \
    --decode-repeats 2 --bd-streams 64 --bd-prompt-tokens 64 --bd-output-tokens 128 \
    --cl-sentences 512 --cl-batch 64 --cl-preamble-tokens 48 --cl-sentence-tokens 16 \
    ${BENCH_ARGS:-}
  # Single-stream decode against bare mlx-lm in one process, many alternating runs: the
  # workload above meets bare mlx-lm minutes later in another process, two runs each.
  if grep -qx single_stream <<< "$(tr , '\n' <<< "$wanted")"; then
    python3 -m bench.decode_parity "$models/$name" --max-tokens 256 --repeats 9 \
      --out "$out/$name-decode-parity"
  fi
  [ -n "${BENCH_KEEP_MODELS:-}" ] || rm -rf "${models:?}/$name" "${models:?}/$name.done" \
    "${models:?}/$name.gguf" "${models:?}/$name.gguf.done"
done
if grep -qx snapshot_models <<< "$(tr , '\n' <<< "$wanted")"; then
  python3 -m bench --workloads snapshot_models --out "$out" "${sizes[@]}"
fi
