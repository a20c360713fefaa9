#!/usr/bin/env bash
# The GPU benchmark: random bf16 models shaped like Llama 3.2 1B and Llama 3.1 8B, both
# servers on each (one start per server: an 8B load takes a while), results under
# OUT/<shape>/ (no plots: `python -m bench.report OUT/<shape>/results.json` draws them
# where matplotlib is installed).
#   bash bench/gpu.sh OUT [shape ...]      # default shapes: llama-1b llama-8b
set -euo pipefail
out=${1:?usage: bench/gpu.sh OUT [shape ...]}
shift
models=${BENCH_MODELS_DIR:-/tmp/bench-models}
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(llama-1b llama-8b)
mkdir -p "$out"
nvidia-smi > "$out/nvidia-smi.txt"
for s in "${shapes[@]}"; do
  python3 -m bench.models "$models/$s" --shape "$s" --dtype bfloat16
  python3 -m bench --model "$models/$s" --out "$out/$s" --no-plots --no-restart-per-workload \
    --sp-groups 8 --sp-prompts-per-group 4 --sp-system-tokens 2000 \
    --sp-question-tokens 64 --sp-output-tokens 64 --sp-concurrency 16 \
    --mt-conversations 8 --mt-turns 4 --mt-system-tokens 1000 --mt-user-tokens 200 \
    --mt-output-tokens 64 --ns-prompts 32 --ns-prompt-tokens 1000 --ns-output-tokens 64 \
    --ns-concurrency 16 --lc-document-tokens 6000 --lc-questions 4 \
    --lc-question-tokens 64 --lc-output-tokens 32 --decode-output-tokens 128 \
    --decode-repeats 2
  rm -rf "${models:?}/$s"
done
