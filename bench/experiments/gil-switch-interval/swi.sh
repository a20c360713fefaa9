M=/tmp/bench-models/llama-1b-vocab131072
[ -d $M ] || python3 -m bench.models $M --shape llama-1b --tokenizer-from /tmp/tok131k > /dev/null
S=(--mt-conversations 8 --mt-turns 4 --mt-system-tokens 1000 --mt-user-tokens 200 --mt-output-tokens 64 --bd-streams 64 --bd-prompt-tokens 64 --bd-output-tokens 128 --sp-groups 8 --sp-prompts-per-group 4 --sp-system-tokens 2000 --sp-question-tokens 64 --sp-output-tokens 64 --sp-concurrency 16)
i=0
for v in 5 0.5 0.1 5 0.5 0.1; do i=$((i+1))
SWITCH_MS=$v PYTHONPATH=$PWD/.dev/swi:$PYTHONPATH timeout 100 python3 -m bench --model $M --out /tmp/sw$i --servers radix-mlx --workloads multi_turn,batch_decode,shared_prefix --no-raw --no-structured --no-plots --no-restart-per-workload --radix-mlx-args "--max-batch-size 64" "${S[@]}" > $OUT/sw$i.log 2>&1; echo "run $i switch_ms=$v rc=$?"
mkdir -p $OUT/sw$i-$v && cp /tmp/sw$i/results.md $OUT/sw$i-$v/ 2>/dev/null
grep -E "^\| (multi_turn|batch_decode|shared_prefix) \| radix" /tmp/sw$i/results.md
done
