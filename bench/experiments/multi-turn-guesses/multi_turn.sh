# Sourced by the multi-turn A/B scripts (this folder's ab.sh, ../cuda-graphs-prefill/ab.sh),
# on the GPU machine: MLX and the wheels from /tmp/site, the Llama SHAPE (default llama-8b)
# built once with the SmolLM2 tokenizer in /tmp/stage/smol, and
#   run_multi_turn NAME FLAGS [VAR=VALUE ...]
# which runs gpu.sh's multi-turn (8 chats of 4 turns) against radix-mlx alone, started with
# FLAGS (its steps logged) and the variables given, into OUT/NAME, and prints by_turn.py's
# line for it.
export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD
SHAPE=${SHAPE:-llama-8b}
M=/tmp/bench-models/$SHAPE-vocab49152
MULTI_TURN_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p /tmp/bench-models
[ -d $M ] || python3 -m bench.models $M --shape $SHAPE --dtype bfloat16 --tokenizer-from /tmp/stage/smol > /dev/null

run_multi_turn() {
  local name=$1 flags=$2
  shift 2
  env "$@" timeout 240 python3 -m bench --model $M --out "$OUT/$name" --servers radix-mlx \
    --workloads multi_turn --rounds 1 --no-structured --no-plots --no-raw \
    --radix-mlx-args "--max-batch-size 64 --log-level debug $flags" --mt-conversations 8 \
    --mt-turns 4 --mt-system-tokens 1000 --mt-user-tokens 200 --mt-output-tokens 64 \
    > "$OUT/$name.log" 2>&1
  python3 "$MULTI_TURN_DIR/by_turn.py" "$OUT/$name/results.json" "$name"
}
