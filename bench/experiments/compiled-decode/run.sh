#!/usr/bin/env bash
# The decode.py comparison on each pre-drawn shape (bench.models), with MLX's CUDA graphs
# off (the server's setting) and on (MLX's default), at a short and a long context.
#   bash bench/experiments/compiled-decode/run.sh OUT_DIR MODELS_DIR SHAPE...
out=$1 models=$2; shift 2
mkdir -p "$out"
here=$(dirname "$0")
for shape in "$@"; do
  for graphs in 0 1; do
    for prompt in 64 2000; do
      name=$shape-graphs$graphs-prompt$prompt
      MLX_USE_CUDA_GRAPHS=$graphs MLX_CUDA_USE_CUDNN_SDPA=0 timeout 300 python3 "$here/decode.py" \
        "$models/$shape" --prompt-tokens $prompt --max-tokens 256 --repeats 5 \
        --out "$out/$name.json" > "$out/$name.log" 2>&1
      python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], r['tok_s'], r['cpu_us_per_token'], r['greedy_tokens_agreed'])" "$out/$name.json" $name
    done
  done
done
