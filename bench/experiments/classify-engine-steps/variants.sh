# /v1/classify on a GPU under server variants, each "TREE CONCURRENCY [server flags]":
# TREE is "work" (this checkout) or "base" (an older checkout's engine/, server/, radix/
# and bench/ at $BASE); prints sentences/s of three passes of 4096 sentences in lists of
# 64 and, from /metrics, engine steps, step seconds and step CPU seconds per list.
#   VARIANTS=("base 4" "work 4" "work 8 --max-queue 1024 --prefill-chunk-tokens 8192")
#   OUT=DIR BASE=DIR source bench/experiments/classify-engine-steps/variants.sh
# (MLX installed under /tmp/site, SmolLM2's tokenizer in /tmp/stage/smol. HEALTH_WAIT:
# seconds a server may take to start; a fresh machine's first start compiles kernels.)
export PATH=/tmp/site/bin:$PATH NCCL_NVLS_ENABLE=0
M=${M:-/tmp/bench-models/llama-1b-vocab49152}
[ -d $M ] || PYTHONPATH=/tmp/site:$PWD python3 -m bench.models $M --shape llama-1b --tokenizer-from /tmp/stage/smol > /dev/null
metric() { curl -s http://127.0.0.1:8391/metrics | awk -v k="$1" 'index($1, k "{")==1 {print $2}'; }
variant() {  # tree conc flags...
  tree=$1 conc=$2; shift 2
  root=$PWD; [ $tree = base ] && root=$PWD/$BASE
  (cd $root && PYTHONPATH=/tmp/site:$root exec python3 -m server.launch.cli serve --model $M --port 8391 --max-batch-size 256 --disk-cache-bytes 0 --log-level warning "$@") > $OUT/server-$tree-$conc-$(echo "$@" | tr -d ' -').log 2>&1 &
  ok=0; for i in $(seq ${HEALTH_WAIT:-150}); do curl -sf http://127.0.0.1:8391/health > /dev/null && { ok=1; break; }; sleep 1; done
  [ $ok = 1 ] || { echo "server not up"; pkill -TERM -f "server.launch.cli serve"; sleep 3; return; }
  PYTHONPATH=/tmp/site:$PWD python3 bench/experiments/classify-engine-steps/drive.py $M http://127.0.0.1:8391 1 100 $conc > /dev/null
  s0=$(metric radix_mlx_engine_steps_total); t0=$(metric radix_mlx_engine_step_seconds_total); c0=$(metric radix_mlx_engine_step_cpu_seconds_total)
  r=$(PYTHONPATH=/tmp/site:$PWD python3 bench/experiments/classify-engine-steps/drive.py $M http://127.0.0.1:8391 3 200 $conc)
  s1=$(metric radix_mlx_engine_steps_total); t1=$(metric radix_mlx_engine_step_seconds_total); c1=$(metric radix_mlx_engine_step_cpu_seconds_total)
  python3 -c "l=3*64; print('$tree', '$*', '$r', 'steps/list %.2f step ms/list %.1f cpu ms/list %.1f' % (($s1-$s0)/l, ($t1-$t0)*1e3/l, ($c1-$c0)*1e3/l))" | tee -a $OUT/variants.txt
  pkill -TERM -f "server.launch.cli serve"; sleep 3
}
for v in "${VARIANTS[@]}"; do eval variant $v; done
