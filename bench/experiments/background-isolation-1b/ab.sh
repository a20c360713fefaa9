# A/B on one lease: an older tree (OLD, a `git archive` of the commit before the change) against the working tree, radix-mlx only, multi_turn + shared_prefix at gpu.sh's 1B sizes.
# Run on the GPU machine with MLX's CUDA wheels installed under /tmp/site and SmolLM2's tokenizer in /tmp/stage/smol; OLD defaults to .dev/ab-old. ROUNDS (default 2) alternations.
M=/tmp/bench-models/llama-1b-vocab49152
mkdir -p /tmp/bench-models
[ -d $M ] || PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD python3 -m bench.models $M --shape llama-1b --dtype bfloat16 --tokenizer-from /tmp/stage/smol > /dev/null 2>&1
ARGS="--no-plots --no-restart-per-workload --workloads multi_turn,shared_prefix --servers radix-mlx --no-raw --no-structured --radix-mlx-args=--max-batch-size=64 --sp-groups 8 --sp-prompts-per-group 4 --sp-system-tokens 2000 --sp-question-tokens 64 --sp-output-tokens 64 --sp-concurrency 16 --mt-conversations 8 --mt-turns 4 --mt-system-tokens 1000 --mt-user-tokens 200 --mt-output-tokens 64"
NEW=$PWD; OLD=${OLD:-$PWD/.dev/ab-old}
for round in $(seq ${ROUNDS:-2}); do
  for v in old new; do
    [ $v = old ] && D=$OLD || D=$NEW
    (cd $D && PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$D python3 -m bench --model $M --out $OUT/$v-$round $ARGS > $OUT/$v-$round.log 2>&1)
    echo "== $v round $round"; grep -E "^\| (multi_turn|shared_prefix) \| radix" $OUT/$v-$round/results.md
  done
done
