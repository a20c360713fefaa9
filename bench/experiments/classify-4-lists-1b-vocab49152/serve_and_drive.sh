#!/usr/bin/env bash
# A server on MODEL_DIR under classify lists, LISTS in flight: one warm-up pass of 1024
# sentences, then 3 passes of 4096 (../classify-profile-1b/drive.py), the server's log
# and its /metrics before and after the passes (engine steps and their seconds) beside
# them in OUT; with SPY=1, py-spy samples every thread of the server meanwhile.
#   bash serve_and_drive.sh MODEL_DIR OUT LISTS [server flags...]
set -euo pipefail
model=$1 out=$2 lists=$3
shift 3
mkdir -p "$out"
port=8391
python3 -m server.launch.cli serve --model "$model" --port $port --max-batch-size 256 \
  --disk-cache-bytes 0 "$@" > "$out/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
until curl -sf http://127.0.0.1:$port/health > /dev/null; do kill -0 $server || exit 1; sleep 1; done
drive=$(dirname "$0")/../classify-profile-1b/drive.py
python3 "$drive" "$model" http://127.0.0.1:$port 1 100 "$lists" 1024 > "$out/warm-up.txt"
if [ -n "${SPY:-}" ]; then
  py-spy record --pid $server --rate 250 --threads --format raw --output "$out/stacks.txt" \
    --duration 40 > "$out/py-spy.log" 2>&1 &
  spy=$!
fi
curl -s http://127.0.0.1:$port/metrics > "$out/metrics-before.txt"
python3 "$drive" "$model" http://127.0.0.1:$port 3 200 "$lists" 4096 | tee "$out/passes.txt"
curl -s http://127.0.0.1:$port/metrics > "$out/metrics-after.txt"
if [ -n "${SPY:-}" ]; then kill -INT $spy; wait $spy || true; fi
