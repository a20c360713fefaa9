M=/tmp/bench-models/llama-1b-vocab131072
[ -d $M ] || python3 -m bench.models $M --shape llama-1b --tokenizer-from /tmp/tok131k > /dev/null
S=(--sp-groups 8 --sp-prompts-per-group 4 --sp-system-tokens 2000 --sp-question-tokens 64 --sp-output-tokens 64 --sp-concurrency 16 --mt-conversations 8 --mt-turns 4 --mt-system-tokens 1000 --mt-user-tokens 200 --mt-output-tokens 64 --ns-prompts 32 --ns-prompt-tokens 1000 --ns-output-tokens 64 --ns-concurrency 16 --lc-document-tokens 6000 --lc-questions 4 --lc-question-tokens 64 --lc-output-tokens 32)
i=0
for v in 1 0 1 0; do i=$((i+1))
MLX_CUDA_USE_CUDNN_SDPA=$v timeout 140 python3 -m bench --model $M --out /tmp/cd$i --servers radix-mlx --workloads multi_turn,shared_prefix,long_context,no_share --no-raw --no-structured --no-plots --no-restart-per-workload --radix-mlx-args "--max-batch-size 64" "${S[@]}" > $OUT/cd$i.log 2>&1; echo "run $i cudnn=$v rc=$?"
mkdir -p $OUT/cd$i-cudnn$v; cp /tmp/cd$i/results.md /tmp/cd$i/results.json $OUT/cd$i-cudnn$v/ 2>/dev/null
grep -E "^\| (multi_turn|shared_prefix|long_context|no_share) \| radix" /tmp/cd$i/results.md; grep -A3 "warm TTFT p50" /tmp/cd$i/results.md | tail -1
done
