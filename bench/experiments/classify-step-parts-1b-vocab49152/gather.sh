# A read-gather window (gather.diff applied: READ_GATHER_MS) against the engine's prefill
# slots (--max-queue 1024: four lists of 64 in the engine, not two), through HTTP:
#   bash gather.sh   (on the GPU machine; MLX and the wheels in /tmp/site)
export PATH=${BIN:-/tmp/site/bin}:$PATH
M=${M:-/tmp/bench-models/llama-1b-vocab49152}
mkdir -p /tmp/bench-models
[ -d $M ] || PYTHONPATH=/tmp/site:$PWD python3 -m bench.models $M --shape llama-1b --dtype bfloat16 --tokenizer-from /tmp/stage/smol > /dev/null
[ -f /tmp/wls.pkl ] || PYTHONPATH=/tmp/site:$PWD python3 bench/experiments/classify-step-parts-1b-vocab49152/drive.py build $M /tmp/wls.pkl
S=$OUT/summary.txt
serve() { # name gather_ms conc [flags]
  name=$1 gather=$2 conc=$3; shift 3
  (READ_GATHER_MS=$gather PYTHONPATH=/tmp/site:$PWD exec python3 -m server.launch.cli serve --model $M --port 8391 --disk-cache-bytes 0 "$@" > /tmp/server-$name.log 2>&1) &
  pid=$!
  until curl -sf http://127.0.0.1:8391/health > /dev/null; do sleep 0.5; done
  echo "== $name gather=$gather conc=$conc $*" >> $S
  PYTHONPATH=/tmp/site:$PWD python3 bench/experiments/classify-step-parts-1b-vocab49152/drive.py run /tmp/wls.pkl http://127.0.0.1:8391 $conc >> $S 2>&1
  curl -s http://127.0.0.1:8391/metrics | grep -E "^radix_mlx_engine_step" | sed 's/{.*}//' >> $S
  kill $pid; wait $pid; sleep 1
}
for r in 1 2; do
  serve base$r 0 4
  serve q1024-g0-$r 0 4 --max-queue 1024
  serve q1024-g3-$r 3 4 --max-queue 1024
done
serve q1024-g6 6 4 --max-queue 1024
serve base-g3 3 4
serve one-g0 0 1 --max-queue 1024
serve one-g3 3 1 --max-queue 1024
cat $S
