# Long-context warm TTFT and multi-turn TTFT, radix-mlx only, a server of this tree
# against one of BASE (a `git archive` copy of the tree before the change, bench/ included),
# trees alternating, ROUNDS rounds, 1B shape (issue 36). Used for the first token read at
# join (BASE 9458133) and for the first token sampled in prefill (BASE 29500b1):
#   BASE=DIR bash ab.sh OUT   (on the GPU machine; MLX and the wheels in /tmp/site)
export PATH=${BIN:-/tmp/site/bin}:$PATH
OUT=${1:?output folder}
BASE=${BASE:?the other tree}
M=${M:-/tmp/bench-models/llama-1b-vocab49152}
mkdir -p /tmp/bench-models $OUT
[ -d $M ] || PYTHONPATH=/tmp/site:$PWD python3 -m bench.models $M --shape llama-1b --dtype bfloat16 --tokenizer-from /tmp/stage/smol > /dev/null
NEW=$PWD
for round in $(seq ${ROUNDS:-2}); do for tree in $BASE $NEW; do
  name=$([ $tree = $NEW ] && echo new || echo base)-$round
  (cd $tree && PYTHONPATH=/tmp/site:$tree timeout 200 python3 -m bench --model $M --out $OUT/$name \
    --servers radix-mlx --workloads single_stream,long_context,multi_turn --rounds 1 --no-structured --no-plots --no-raw \
    --radix-mlx-args '--max-batch-size 64' --mt-conversations 8 --mt-turns 4 --mt-system-tokens 1000 \
    --mt-user-tokens 200 --mt-output-tokens 64 --lc-document-tokens 6000 --lc-questions 12 \
    --lc-question-tokens 64 --lc-output-tokens 32 --decode-output-tokens 128 --decode-repeats 2 > $OUT/$name.log 2>&1)
  python3 - $OUT/$name/results.json $name <<'PY' | tee -a $OUT/summary.txt
import json, sys
d = json.load(open(sys.argv[1]))["servers"]["radix-mlx"]["workloads"]
lc, mt, ss = d.get("long_context", {}), d.get("multi_turn", {}), d.get("single_stream", {})
print(sys.argv[2], "lc warm p50 %.1f ms" % (1000 * lc.get("ttft_warm_p50", 0)),
      "mt ttft p50 %.1f ms" % (1000 * mt.get("ttft_p50", 0)), "mt tok/s %.0f" % mt.get("output_tok_s", 0),
      "ss decode %.0f tok/s" % ss.get("decode_tok_s", 0), flush=True)
PY
done; done
