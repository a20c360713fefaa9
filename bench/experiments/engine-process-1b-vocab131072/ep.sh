M=/tmp/bench-models/llama-1b-vocab131072
[ -d $M ] || python3 -m bench.models $M --shape llama-1b --tokenizer-from /tmp/tok131k > /dev/null
S=(--mt-conversations 8 --mt-turns 4 --mt-system-tokens 1000 --mt-user-tokens 200 --mt-output-tokens 64 --bd-streams 64 --bd-prompt-tokens 64 --bd-output-tokens 128 --sp-groups 8 --sp-prompts-per-group 4 --sp-system-tokens 2000 --sp-question-tokens 64 --sp-output-tokens 64 --sp-concurrency 16)
i=0
for v in false true false true; do i=$((i+1))
timeout 110 python3 -m bench --model $M --out /tmp/ep$i --servers radix-mlx --workloads multi_turn,batch_decode,shared_prefix --no-raw --no-structured --no-plots --no-restart-per-workload --radix-mlx-args "--max-batch-size 64 --engine-process $v" "${S[@]}" > $OUT/ep$i-$v.log 2>&1; echo "run $i engine_process=$v rc=$?"
grep -E "^\| (multi_turn|batch_decode|shared_prefix) \| radix" /tmp/ep$i/results.md
done
