# Which MLX CUDA kernels get JIT-compiled after the server says it is ready?
export MLX_PTX_CACHE_DIR=/tmp/ptx-fresh; rm -rf $MLX_PTX_CACHE_DIR; mkdir -p $MLX_PTX_CACHE_DIR
M=/tmp/bench-models/llama-1b-vocab49152
[ -d $M ] || python3 -m bench.models $M --shape llama-1b --dtype bfloat16 --tokenizer-from /tmp/tok49k > /dev/null
timeout 400 python3 -m bench --model $M --out /tmp/jit --servers radix-mlx --no-plots --no-raw --no-structured --no-restart-per-workload \
 --workloads shared_prefix,multi_turn,no_share,long_context,batch_decode,classify --radix-mlx-args '--max-batch-size 64' \
 --sp-groups 8 --sp-prompts-per-group 4 --sp-system-tokens 2000 --sp-question-tokens 64 --sp-output-tokens 64 --sp-concurrency 16 \
 --mt-conversations 8 --mt-turns 4 --mt-system-tokens 1000 --mt-user-tokens 200 --mt-output-tokens 64 \
 --ns-prompts 32 --ns-prompt-tokens 1000 --ns-output-tokens 64 --ns-concurrency 16 --lc-document-tokens 6000 --lc-questions 4 \
 --lc-question-tokens 64 --lc-output-tokens 32 --bd-streams 64 --bd-prompt-tokens 64 --bd-output-tokens 128 \
 --cl-sentences 512 --cl-batch 64 --cl-preamble-tokens 48 --cl-sentence-tokens 16 > $OUT/bench.log 2>&1
echo rc=$?
cp /tmp/jit/logs/*.log $OUT/ 2>/dev/null; cp /tmp/jit/results.json $OUT/
cd $MLX_PTX_CACHE_DIR && ls -l --time-style=+%H:%M:%S.%N *.ptx | awk '{print $6, $7}' | sort > $OUT/ptx-times.txt
tar czf $OUT/ptx-src.tgz *.cu
grep -i "ready\|warm" $OUT/*.log | head; wc -l $OUT/ptx-times.txt; grep -A12 "## Targets" /tmp/jit/results.md
