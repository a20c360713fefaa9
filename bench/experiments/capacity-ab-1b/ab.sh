set -e
M=/tmp/m1b
python3 -m bench.models $M --shape llama-1b --dtype bfloat16 --tokenizer-from /tmp/tok49k > /dev/null
S="--sp-groups 8 --sp-prompts-per-group 4 --sp-system-tokens 2000 --sp-question-tokens 64 --sp-output-tokens 64 --sp-concurrency 16 --mt-conversations 8 --mt-turns 4 --mt-system-tokens 1000 --mt-user-tokens 200 --mt-output-tokens 64 --ns-prompts 32 --ns-prompt-tokens 1000 --ns-output-tokens 64 --ns-concurrency 16"
for i in 1 2; do for v in exact rounded; do
  cp .dev/ab/$v.py engine/mlx_lm_internals.py
  python3 -m bench --model $M --servers radix-mlx --workloads shared_prefix,multi_turn,no_share --no-raw --no-structured --no-plots --no-restart-per-workload --radix-mlx-args "--max-batch-size 64" $S --out /tmp/ab/$v-$i > /tmp/ab-$v-$i.log 2>&1
  grep "| radix-mlx |" /tmp/ab/$v-$i/results.md | sed "s/^/$v $i /"
done; done
cp .dev/ab/exact.py engine/mlx_lm_internals.py
