# Long-context warm TTFT through the server, an older tree (OLD: a `git archive` of c90e987) against the working tree, 2 rounds alternating.
# Run on the GPU machine with MLX's CUDA wheels under /tmp/site and SmolLM2's tokenizer in /tmp/stage/smol.
export PATH=/tmp/site/bin:$PATH
M=/tmp/bench-models/llama-1b-vocab49152
mkdir -p /tmp/bench-models
[ -d $M ] || PYTHONPATH=/tmp/site:$PWD python3 -m bench.models $M --shape llama-1b --dtype bfloat16 --tokenizer-from /tmp/stage/smol > /dev/null 2>&1
ARGS="--no-plots --no-restart-per-workload --workloads single_stream,long_context --servers radix-mlx --no-raw --no-structured --radix-mlx-args=--max-batch-size=64 --lc-document-tokens 6000 --lc-questions 16 --lc-question-tokens 64 --lc-output-tokens 32 --decode-prompt-tokens 64 --decode-output-tokens 128"
NEW=$PWD; OLD=${OLD:?a git archive of the older commit}
for round in 1 2; do
  for v in old new; do
    [ $v = old ] && D=$OLD || D=$NEW
    (cd $D && PYTHONPATH=/tmp/site:$D python3 -m bench --model $M --out $OUT/lc-$v-$round $ARGS > $OUT/lc-$v-$round.log 2>&1)
    echo "== $v round $round"; grep -A4 "Long context: cold and warm" $OUT/lc-$v-$round/results.md | tail -2
  done
done
