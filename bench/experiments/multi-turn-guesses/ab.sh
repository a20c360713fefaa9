# The multi-turn workload at gpu.sh's sizes, radix-mlx alone, the default server against
# `--prefill-next-turn false`, alternating, ROUNDS rounds (issue 36). On the 8B shape the
# next-turn guesses' forward runs ahead of every turn that follows its reply at once
# (bench/results/nvidia-h200/multi-turn-8b-vocab49152); on the 1B shape they gained
# multi-turn 13-20% (background-isolation-1b). Each server logs its steps; summary.txt
# has each run's TTFT p50, output tok/s and TTFT p50 by turn:
#   SHAPE=llama-8b ROUNDS=2 bash ab.sh OUT   (on the GPU machine: multi_turn.sh says what
#                                             it needs there)
OUT=${1:?output folder}
mkdir -p "$OUT"
source "$(dirname "$0")/multi_turn.sh"
for round in $(seq "${ROUNDS:-2}"); do for variant in guesses no-guesses; do
  flags=
  [ $variant = no-guesses ] && flags="--prefill-next-turn false"
  run_multi_turn $variant-$round "$flags" | tee -a "$OUT/summary.txt"
done; done
