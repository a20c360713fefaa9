# 64-stream batch decode on the GPU machine with accepted sockets' TCP_NOTSENT_LOWAT
# (7bccb78, server/http/uvicorn_protocol.py) and without it, alternating:
# bench/batch_parity.py (bare BatchGenerator, the engine in process, the server over HTTP,
# each run in one process) from this checkout and from a copy with the option's call
# taken out. Needs MLX and the wheels in /tmp/site (../../../../shared/device/README.md)
# and BENCH_TOKENIZER (SmolLM2's converted directory: its 49k vocabulary).
#   ROUNDS=3 bash bench/experiments/notsent-lowat-batch-decode/ab.sh OUT
set -u
out=${1:?output folder}
m=/tmp/bench-models/llama-1b-vocab49152
mkdir -p /tmp/bench-models "$out"
if [ ! -f $m.done ]; then
  python3 -m bench.models $m --shape llama-1b --dtype bfloat16 \
    --tokenizer-from "$BENCH_TOKENIZER" && touch $m.done
fi
rm -rf /tmp/without && mkdir /tmp/without && cp -r bench engine server radix /tmp/without/
sed -i 's/^        _hold_little_unsent(transport)$/        pass/' \
  /tmp/without/server/http/uvicorn_protocol.py
here=$PWD
for i in $(seq "${ROUNDS:-3}"); do
  for v in with without; do
    dir=$here; [ $v = without ] && dir=/tmp/without
    (cd $dir && python3 -m bench.batch_parity $m --streams 64 --max-tokens 128 \
      --repeats 3 --out "$out/$v-$i" > "$out/$v-$i.log" 2>&1)
  done
done
