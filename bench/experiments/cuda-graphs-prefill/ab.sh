# Does MLX's CUDA graph capture make the server's prefill steps host-bound? (issue 36)
# On an H200 the 8B shape's multi-turn steps that compute turns over a cached prefix took
# 89-178 ms, their engine thread busy on the CPU for almost all of it, inside `mx.eval`
# (py-spy), where the same forward alone takes 25-29 ms. MLX's CUDA backend records each
# step's kernels into CUDA graphs; a step whose shapes it has not met (every turn's) builds
# and instantiates new ones. gpu.sh's multi-turn at 8B, radix-mlx alone, MLX's default
# against MLX_USE_CUDA_GRAPHS=0 (plain launches), with and without next-turn guesses,
# alternating, ROUNDS rounds; MLX's JIT cache (/tmp/mlx) counted after each run, the
# step logs kept. summary.txt: each run's TTFT p50, output tok/s, TTFT p50 by turn.
#   SHAPE=llama-8b ROUNDS=2 bash ab.sh OUT   (on the GPU machine; MLX and the
#                                  wheels in /tmp/site, the SmolLM2 tokenizer in /tmp/stage/smol)
export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD
OUT=${1:?output folder}
SHAPE=${SHAPE:-llama-8b}
M=/tmp/bench-models/$SHAPE-vocab49152
here=$(dirname "$0")
mkdir -p /tmp/bench-models "$OUT"
[ -d $M ] || python3 -m bench.models $M --shape $SHAPE --dtype bfloat16 --tokenizer-from /tmp/stage/smol > /dev/null
for round in $(seq "${ROUNDS:-2}"); do for graphs in on off; do for guesses in on off; do
  name=graphs-$graphs-guesses-$guesses-$round
  flags="--max-batch-size 64 --log-level debug --prefill-next-turn $([ $guesses = on ] && echo true || echo false)"
  env $([ $graphs = off ] && echo MLX_USE_CUDA_GRAPHS=0) timeout 240 python3 -m bench \
    --model $M --out "$OUT/$name" --servers radix-mlx \
    --workloads multi_turn --rounds 1 --no-structured --no-plots --no-raw \
    --radix-mlx-args "$flags" --mt-conversations 8 --mt-turns 4 --mt-system-tokens 1000 \
    --mt-user-tokens 200 --mt-output-tokens 64 > "$OUT/$name.log" 2>&1
  echo "$(python3 "$here/../multi-turn-guesses/by_turn.py" "$OUT/$name/results.json" $name)" \
    "jit cache: $(find /tmp/mlx -type f 2>/dev/null | wc -l) files" | tee -a "$OUT/summary.txt"
done; done; done
