# A/B of the first token read at join (working tree) against 9458133 (a `git archive` copy in .dev/base), 1B shape:
# long-context warm TTFT and multi-turn TTFT, radix-mlx only, trees alternating.
export PATH=/tmp/site/bin:$PATH
M=/tmp/bench-models/llama-1b-vocab49152
mkdir -p /tmp/bench-models
[ -d $M ] || PYTHONPATH=/tmp/site:$PWD python3 -m bench.models $M --shape llama-1b --dtype bfloat16 --tokenizer-from /tmp/stage/smol > /dev/null
NEW=$PWD
for round in 1 2; do for tree in $NEW/.dev/base $NEW; do
  name=$([ $tree = $NEW ] && echo new || echo base)-$round
  (cd $tree && PYTHONPATH=/tmp/site:$tree timeout 200 python3 -m bench --model $M --out $OUT/$name \
    --servers radix-mlx --workloads single_stream,long_context,multi_turn --rounds 1 --no-structured --no-plots --no-raw \
    --radix-mlx-args '--max-batch-size 64' --mt-conversations 8 --mt-turns 4 --mt-system-tokens 1000 \
    --mt-user-tokens 200 --mt-output-tokens 64 --lc-document-tokens 6000 --lc-questions 12 \
    --lc-question-tokens 64 --lc-output-tokens 32 --decode-output-tokens 128 --decode-repeats 2 > $OUT/$name.log 2>&1)
  python3 - $OUT/$name/results.json $name <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))["servers"]["radix-mlx"]["workloads"]
lc, mt, ss = d.get("long_context", {}), d.get("multi_turn", {}), d.get("single_stream", {})
print(sys.argv[2], "lc warm p50 %.1f ms" % (1000 * lc.get("ttft_warm_p50", 0)),
      "mt ttft p50 %.1f ms" % (1000 * mt.get("ttft_p50", 0)), "mt tok/s %.0f" % mt.get("output_tok_s", 0),
      "ss decode %.0f tok/s" % ss.get("decode_tok_s", 0), flush=True)
PY
done; done
