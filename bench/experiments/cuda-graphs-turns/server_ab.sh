# The server with MLX's CUDA graphs on and off, on the 1B shape (SmolLM2's vocabulary), on
# the GPU machine: decode parity (bench/decode_parity.py: bare mlx-lm, the engine in
# process and the server, each path under the setting given) and gpu.sh's multi-turn
# against radix-mlx alone, ROUNDS rounds, the settings alternating. Needs what
# ../multi-turn-guesses/multi_turn.sh needs (MLX and the wheels in /tmp/site, the SmolLM2
# tokenizer in /tmp/stage/smol).
#   ROUNDS=2 bash server_ab.sh OUT
OUT=${1:?output folder}
export SHAPE=llama-1b
source "$(dirname "$0")/../multi-turn-guesses/multi_turn.sh"
mkdir -p "$OUT/parity"
for round in $(seq "${ROUNDS:-2}"); do for graphs in 1 0; do
  MLX_USE_CUDA_GRAPHS=$graphs timeout 170 python3 -m bench.decode_parity $M --repeats 5 \
    --out "$OUT/parity/graphs$graphs-$round" > "$OUT/parity/graphs$graphs-$round.json"
  run_multi_turn "multi-turn/graphs$graphs-$round" "" MLX_USE_CUDA_GRAPHS=$graphs
done; done
