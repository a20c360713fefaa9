#!/usr/bin/env bash
# Run a command while a busy loop takes one core's worth of work, as another job on the
# machine would (issue 36's CPU targets "under load"), e.g.
#   bench/experiments/cpu-targets/under_load.sh make bench BENCH_ARGS='--model <bench-seed0> \
#     --workloads shared_prefix,multi_turn --servers radix-mlx,mlx-lm --no-structured \
#     --no-plots --no-raw --out DIR'
set -euo pipefail
python3 -c "
while True:
    sum(i * i for i in range(100000))
" &
hog=$!
trap 'kill $hog' EXIT
"$@"
