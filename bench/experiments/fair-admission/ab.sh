# Fair admission before and after, on the GPU machine (results:
# bench/results/nvidia-h200/fair-admission-1b-vocab49152). From the checkout's root there,
# with MLX staged as ../shared/device/README.md says (its wheels in .dev/cuda-w), the
# SmolLM2 tokenizer in .dev/smol-tok, and the code before as
# `git archive f53cace -- . ':!bench/results' > .dev/g54/base.tar`:
#   V=new W=shared_prefix,multi_turn,batch_decode,classify bash ab.sh   # this checkout
#   V=base W=... bash ab.sh                                             # the tar's code
# SERVERS=radix-mlx leaves mlx-lm out of a V=new run; T caps the run's seconds.
set -e
export PATH=/tmp/site/bin:$PATH
python3 -c "import sys; sys.path.insert(0,'/tmp/site'); import mlx.core" 2>/dev/null || bash .dev/cuda-w/install.sh > /dev/null 2>&1
models=/tmp/bench-models; name=llama-1b-vocab49152
if [ ! -d $models/$name ]; then
  PYTHONPATH=/tmp/site:$PWD python3 -m bench.models $models/$name --shape llama-1b --dtype bfloat16 --tokenizer-from .dev/smol-tok | tail -2
fi
root=$PWD; servers=${SERVERS:-radix-mlx,mlx-lm}
if [ "$V" = base ]; then
  rm -rf /tmp/base && mkdir -p /tmp/base && tar -xf .dev/g54/base.tar -C /tmp/base
  cp -r .dev/smol-tok /tmp/base/ ; root=/tmp/base; servers=radix-mlx
fi
cd $root
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv
( time PYTHONPATH=/tmp/site:$root timeout ${T:-540} python3 -m bench --model "$models/$name" --out "$OUT/$V" --no-plots \
    --servers $servers --no-restart-per-workload --workloads "$W" \
    --radix-mlx-args "--max-batch-size 64" --mlx-lm-args "--decode-concurrency 64" \
    --sp-groups 8 --sp-prompts-per-group 4 --sp-system-tokens 2000 \
    --sp-question-tokens 64 --sp-output-tokens 64 --sp-concurrency 16 \
    --mt-conversations 8 --mt-turns 4 --mt-system-tokens 1000 --mt-user-tokens 200 \
    --mt-output-tokens 64 --bd-streams 64 --bd-prompt-tokens 64 --bd-output-tokens 128 \
    --cl-sentences 512 --cl-batch 64 --cl-preamble-tokens 48 --cl-sentence-tokens 16 --cl-concurrency 4 \
    --no-structured --rounds 2 ) > $OUT/run-$V.txt 2>&1 || tail -30 $OUT/run-$V.txt
grep -A12 "^| workload | server" $OUT/$V/results.md | head -24
tail -3 $OUT/run-$V.txt
cd $OUT && tar czf logs-$V.tgz $V/logs 2>/dev/null; rm -rf $V/logs
