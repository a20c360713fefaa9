# The multi-turn workload at gpu.sh's sizes, radix-mlx alone, the default server against
# `--prefill-next-turn false`, alternating, ROUNDS rounds (issue 36). On the 8B shape the
# next-turn guesses' forward runs ahead of every turn that follows its reply at once
# (bench/results/nvidia-h200/multi-turn-8b-vocab49152); on the 1B shape they gained
# multi-turn 13-20% (background-isolation-1b). Each server logs its steps; summary.txt
# has each run's TTFT p50, output tok/s and TTFT p50 by turn:
#   SHAPE=llama-8b ROUNDS=2 bash ab.sh OUT   (on the GPU machine; MLX and the
#                                  wheels in /tmp/site, the SmolLM2 tokenizer in /tmp/stage/smol)
export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD
OUT=${1:?output folder}
SHAPE=${SHAPE:-llama-8b}
M=/tmp/bench-models/$SHAPE-vocab49152
mkdir -p /tmp/bench-models "$OUT"
[ -d $M ] || python3 -m bench.models $M --shape $SHAPE --dtype bfloat16 --tokenizer-from /tmp/stage/smol > /dev/null
for round in $(seq "${ROUNDS:-2}"); do for variant in guesses no-guesses; do
  name=$variant-$round
  flags="--max-batch-size 64 --log-level debug"
  [ $variant = no-guesses ] && flags="$flags --prefill-next-turn false"
  timeout 240 python3 -m bench --model $M --out "$OUT/$name" --servers radix-mlx \
    --workloads multi_turn --rounds 1 --no-structured --no-plots --no-raw \
    --radix-mlx-args "$flags" --mt-conversations 8 --mt-turns 4 --mt-system-tokens 1000 \
    --mt-user-tokens 200 --mt-output-tokens 64 > "$OUT/$name.log" 2>&1
  python3 "$(dirname "$0")/by_turn.py" "$OUT/$name/results.json" $name | tee -a "$OUT/summary.txt"
done; done
