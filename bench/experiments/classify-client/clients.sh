# Classify through HTTP on the GPU machine: the benchmark's client against a lean one, at
# four and eight lists in flight, then an engine queue that takes four lists at once.
#   bash bench/experiments/classify-client/clients.sh   (MLX and the wheels in /tmp/site)
export PATH=${BIN:-/tmp/site/bin}:$PATH PYTHONPATH=/tmp/site:$PWD
M=${M:-/tmp/bench-models/llama-1b-vocab49152}
DRIVE="python3 $PWD/bench/experiments/classify-client/drive.py"
mkdir -p /tmp/bench-models
[ -d $M ] || python3 -m bench.models $M --shape llama-1b --dtype bfloat16 --tokenizer-from /tmp/stage/smol > /dev/null
[ -f /tmp/wls.pkl ] || python3 $PWD/bench/experiments/classify-step-parts-1b-vocab49152/drive.py build $M /tmp/wls.pkl
steps() { curl -s localhost:${PORT:-8500}/metrics | grep -E "^radix_mlx_engine_$1" | awk '{s+=$2} END {print s}'; }
serve() {
  python3 -m server --model $M --port ${PORT:-8500} --disk-cache-bytes 0 "$@" > /tmp/srv.log 2>&1 &
  pid=$!
  until curl -sf localhost:${PORT:-8500}/health > /dev/null; do sleep 1; done
}
run() {
  local n=$(steps steps_total) t=$(steps step_seconds_total)
  $DRIVE /tmp/wls.pkl http://127.0.0.1:${PORT:-8500} "$@"
  echo "  steps: $(( $(steps steps_total) - n )), step seconds: $(python3 -c "print(round($(steps step_seconds_total) - $t, 2))")"
}
[ "$1" = --functions-only ] && return
serve
for round in 1 2; do
  run httpx 4; run lean 4; run lean 8; run httpx 8; run lean 4 128
done
kill $pid; wait $pid
serve --max-queue 512
run lean 8; run httpx 4; run lean 4
kill $pid; wait $pid
