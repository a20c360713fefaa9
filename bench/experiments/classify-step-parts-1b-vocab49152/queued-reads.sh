# The code before (OLD: `git archive cbbdf69` unpacked, its engine, server, radix and
# bench) against this tree with queued reads (queued-reads.diff applied), in process
# (measure.py) and through HTTP with default flags, servers alternating:
#   OLD=DIR bash queued-reads.sh   (on the GPU machine; MLX and the wheels in /tmp/site)
export PATH=${BIN:-/tmp/site/bin}:$PATH
M=${M:-/tmp/bench-models/llama-1b-vocab49152}
NEW=$PWD OLD=${OLD:-$PWD/.dev/old}
mkdir -p /tmp/bench-models
[ -d $M ] || PYTHONPATH=/tmp/site:$NEW python3 -m bench.models $M --shape llama-1b --dtype bfloat16 --tokenizer-from /tmp/stage/smol > /dev/null
nvidia-smi --query-gpu=name,clocks.sm --format=csv > $OUT/nvidia-smi.txt
PYTHONPATH=/tmp/site:$NEW python3 bench/experiments/classify-step-parts-1b-vocab49152/drive.py build $M /tmp/wls.pkl
S=$OUT/summary.txt
serve() { # name tree [flags]
  name=$1 tree=$2; shift 2
  (cd $tree && PYTHONPATH=/tmp/site:$tree exec python3 -m server.launch.cli serve --model $M --port 8391 --disk-cache-bytes 0 "$@" > /tmp/server-$name.log 2>&1) &
  pid=$!
  until curl -sf http://127.0.0.1:8391/health > /dev/null; do sleep 0.5; done
  echo "== $name $*" >> $S
  PYTHONPATH=/tmp/site:$NEW python3 bench/experiments/classify-step-parts-1b-vocab49152/drive.py run /tmp/wls.pkl http://127.0.0.1:8391 4 >> $S 2>&1
  curl -s http://127.0.0.1:8391/metrics | grep -E "^radix_mlx_engine_step" >> $S
  kill $pid; wait $pid; sleep 1
}
for r in 1 2; do
  serve old$r $OLD
  serve new$r $NEW
done
serve new-q1024 $NEW --max-queue 1024
serve old-q1024 $OLD --max-queue 1024
for t in new old; do
  tree=$NEW; [ $t = old ] && tree=$OLD
  (cd $tree && PYTHONPATH=/tmp/site:$tree timeout 200 python3 $NEW/bench/experiments/classify-step-parts/measure.py $M --sentences 4096 2>/tmp/measure-$t.err | tail -1 > $OUT/measure-$t.json)
done
cat $S
