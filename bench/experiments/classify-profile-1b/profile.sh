#!/usr/bin/env bash
# The server under the classify workload, sampled by py-spy (every Python thread, 200 Hz,
# raw collapsed stacks), on MODEL_DIR: 3 warm-up passes, then py-spy records 4 passes.
#   bash profile.sh MODEL_DIR OUT [server flags...]
set -euo pipefail
model=$1 out=$2
shift 2
port=8391
python3 -m server.launch.cli serve --model "$model" --port $port --max-batch-size 64 \
  --disk-cache-bytes 0 "$@" > "$out/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
until curl -sf http://127.0.0.1:$port/health > /dev/null; do kill -0 $server || exit 1; sleep 1; done
here=$(dirname "$0")
python3 "$here/drive.py" "$model" http://127.0.0.1:$port 3 100 > "$out/warm-up.txt"
py-spy record --pid $server --rate 200 --threads --format raw --output "$out/stacks.txt" \
  --duration 60 > "$out/py-spy.log" 2>&1 &
spy=$!
sleep 2
python3 "$here/drive.py" "$model" http://127.0.0.1:$port 4 200 | tee "$out/passes.txt"
kill -INT $spy; wait $spy || true
