M=/tmp/bench-models/llama-1b-vocab131072
[ -d $M ] || python3 -m bench.models $M --shape llama-1b --tokenizer-from /tmp/tok131k > /dev/null
for v in "" "--burn" "--burn --switch" ""; do echo "== $v"; timeout 150 python3 .dev/admit.py $M $v 2>&1 | grep -v -i "regex\|warn" | grep -E "sync=|_step|_feed|Generator.decode |_decode|_join|prefill"; done
