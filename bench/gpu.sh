#!/usr/bin/env bash
# The GPU benchmark: random bf16 models shaped like Llama 3.2 1B and Llama 3.1 8B, both
# servers on each (one start per server: an 8B load takes a while), results under
# OUT/<shape>/ (no plots: `python -m bench.report OUT/<shape>/results.json` draws them
# where matplotlib is installed). The decode batch takes 64 streams in both servers.
#   bash bench/gpu.sh OUT [shape ...]      # default shapes: llama-1b llama-8b
#   BENCH_TOKENIZER=MODEL_DIR bash bench/gpu.sh OUT ...
# With BENCH_TOKENIZER the shapes use that model directory's tokenizer (a real vocabulary,
# e.g. the default model's converted directory: SmolLM2's 49k) and are named
# <shape>-vocab<N>; BENCH_WORKLOADS picks workloads (default: all). snapshot_models (tiny
# sliding-window and hybrid demo models, whatever the shape) runs once, into OUT/snapshot-models/.
# With single_stream, each shape's decode parity (bench/decode_parity.py) goes to
# OUT/<shape>-decode-parity/.
set -euo pipefail
out=${1:?usage: bench/gpu.sh OUT [shape ...]}
shift
models=${BENCH_MODELS_DIR:-/tmp/bench-models}
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
nvidia-smi > "$out/nvidia-smi.txt"
for s in "${shapes[@]}"; do
  [ -n "$per_shape" ] || break
  name=$s$suffix
  python3 -m bench.models "$models/$name" --shape "$s" --dtype bfloat16 "${tokenizer[@]}"
  python3 -m bench --model "$models/$name" --out "$out/$name" --no-plots \
    --no-restart-per-workload --workloads "$per_shape" \
    --radix-mlx-args "--max-batch-size 64" --mlx-lm-args "--decode-concurrency 64" \
    "${sizes[@]}" --ns-prompts 32 --ns-prompt-tokens 1000 --ns-output-tokens 64 \
    --ns-concurrency 16 --lc-document-tokens 6000 --lc-questions 4 \
    --lc-question-tokens 64 --lc-output-tokens 32 --decode-output-tokens 128 \
    --decode-repeats 2 --bd-streams 64 --bd-prompt-tokens 64 --bd-output-tokens 128 \
    --cl-sentences 512 --cl-batch 64 --cl-preamble-tokens 48 --cl-sentence-tokens 16
  # Single-stream decode against bare mlx-lm in one process, many alternating runs: the
  # workload above meets bare mlx-lm minutes later in another process, two runs each.
  if grep -qx single_stream <<< "$(tr , '\n' <<< "$wanted")"; then
    python3 -m bench.decode_parity "$models/$name" --max-tokens 256 --repeats 9 \
      --out "$out/$name-decode-parity"
  fi
  [ -n "${BENCH_KEEP_MODELS:-}" ] || rm -rf "${models:?}/$name"
done
if grep -qx snapshot_models <<< "$(tr , '\n' <<< "$wanted")"; then
  python3 -m bench --workloads snapshot_models --out "$out" "${sizes[@]}"
fi
