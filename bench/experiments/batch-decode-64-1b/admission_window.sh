# Batch decode at 64 streams: the default admission window (prefill_batch_size 8: 64 chat prompts
# of ~80 tokens admitted 8 a round) against --prefill-batch-size 64 (bare BatchGenerator
# prefills all 64 in one forward); bare batch_generate after each round (the bench's raw run).
export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD
M=/tmp/bench-models/llama-1b-vocab49152
mkdir -p /tmp/bench-models
[ -d $M ] || python3 -m bench.models $M --shape llama-1b --dtype bfloat16 --tokenizer-from /tmp/stage/smol > /dev/null 2>&1
for w in 8 64; do
  python3 -m bench --model $M --out /tmp/bd-$w --no-plots --no-restart-per-workload --workloads batch_decode \
    --servers radix-mlx --no-structured --rounds 2 --radix-mlx-args "--max-batch-size 64 --prefill-batch-size $w" \
    --bd-streams 64 --bd-prompt-tokens 64 --bd-output-tokens 128 > /tmp/bd-$w.log 2>&1
  echo "window $w:"; grep -E "batch decode output" /tmp/bd-$w/results.md; grep -E "^\| batch_decode" /tmp/bd-$w/results.md
done
