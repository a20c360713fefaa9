# Does MLX's CUDA graph capture make the server's prefill steps host-bound? (issue 36)
# On an H200 the 8B shape's multi-turn steps that compute turns over a cached prefix took
# 89-178 ms, their engine thread busy on the CPU for almost all of it, inside `mx.eval`
# (py-spy), where the same forward alone takes 25-29 ms. MLX's CUDA backend records each
# step's kernels into CUDA graphs; a step whose shapes it has not met (every turn's) builds
# and instantiates new ones. gpu.sh's multi-turn at 8B, radix-mlx alone, graphs on
# (MLX_USE_CUDA_GRAPHS=1, MLX's default) against off (plain launches, the engine's default
# since 3e6e87c; the recorded runs predate it and left the variable unset for "on"), with
# and without next-turn guesses, alternating, ROUNDS rounds; MLX's JIT cache (/tmp/mlx)
# counted after each run, the step logs kept. summary.txt: each run's TTFT p50, output
# tok/s, TTFT p50 by turn.
#   SHAPE=llama-8b ROUNDS=2 bash ab.sh OUT   (on the GPU machine: ../multi-turn-guesses/
#                                             multi_turn.sh says what it needs there)
OUT=${1:?output folder}
mkdir -p "$OUT"
source "$(dirname "$0")/../multi-turn-guesses/multi_turn.sh"
for round in $(seq "${ROUNDS:-2}"); do for graphs in on off; do for guesses in on off; do
  name=graphs-$graphs-guesses-$guesses-$round
  flags="--prefill-next-turn $([ $guesses = on ] && echo true || echo false)"
  echo "$(run_multi_turn $name "$flags" MLX_USE_CUDA_GRAPHS=$([ $graphs = on ] && echo 1 || echo 0))" \
    "jit cache: $(find /tmp/mlx -type f 2>/dev/null | wc -l) files" | tee -a "$OUT/summary.txt"
done; done; done
