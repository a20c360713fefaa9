#!/usr/bin/env bash
# radix-mlx alone on one shape's workloads, MLX's CUDA graphs off (the engine's default)
# and on, alternating, one round each, within the call's time:
#   BENCH_WORKLOADS=... bash bench/experiments/cuda-graphs-workloads/ab.sh OUT SHAPE ORDER...
# where each ORDER is "0 1" or "1 0" (graphs settings in turn); BENCH_KEEP_MODELS=1 and the
# shape's model pre-drawn under /tmp/bench-models, as bench/gpu.sh keeps them.
out=$1 shape=$2; shift 2
mkdir -p "$out"
round=0
for order in "$@"; do
  round=$((round + 1))
  for graphs in $order; do
    left=$((540 - SECONDS)); [ $left -gt 60 ] || break 2
    name=$shape-graphs$graphs-r$round
    echo "== $name ($SECONDS s)"
    MLX_USE_CUDA_GRAPHS=$graphs BENCH_KEEP_MODELS=1 \
      BENCH_ARGS="--no-structured --rounds 1 --servers radix-mlx --seed $round" \
      timeout $left bash bench/gpu.sh "$out/$name" "$shape" > "$out/$name.log" 2>&1
  done
done
