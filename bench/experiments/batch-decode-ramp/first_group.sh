# The 8B shape's batch_decode ramp on one server with its step trace (first_group.py),
# then the same with a 0.5 ms GIL switch interval, then with all 64 prompts admitted at
# once (--prefill-batch-size 64), then bare batch_generate.
# /tmp/site: MLX's CUDA wheels; SMOL: a tokenizer directory (SmolLM2's).
export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD
M=${M:-/tmp/bench-models/llama-8b-vocab49152}
mkdir -p /tmp/switch && cp bench/experiments/gil-switch-interval/switch_sitecustomize.py /tmp/switch/sitecustomize.py
[ -d $M ] || ${PY:-python3} -m bench.models $M --shape llama-8b --dtype bfloat16 --tokenizer-from "$SMOL" > /dev/null
here=bench/experiments/batch-decode-ramp
for variant in default switch-0.5ms window-64; do
  extra=() flags=()
  [ $variant = switch-0.5ms ] && extra=(env SWITCH_MS=0.5 PYTHONPATH=/tmp/switch:$PYTHONPATH)
  [ $variant = window-64 ] && flags=(--prefill-batch-size 64)
  "${extra[@]}" ${PY:-python3} -m server --model $M --port 8500 --disk-cache-bytes 0 --max-batch-size 64 --log-level debug "${flags[@]}" > /tmp/ramp-$variant.log 2>&1 &
  for i in $(seq 300); do curl -sf localhost:8500/health > /dev/null && break; sleep 1; done
  echo "== $variant"
  ${PY:-python3} $here/first_group.py $M http://127.0.0.1:8500 /tmp/ramp-$variant.log
  pkill -f "port 8500"; sleep 3
done
${PY:-python3} -m bench.raw_batch $M batch_decode --shapes '{"bd_streams": 64, "bd_prompt_tokens": 64, "bd_output_tokens": 128}'
