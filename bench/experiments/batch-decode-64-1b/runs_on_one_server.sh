# One server (the 1B shape, debug step log), the batch_decode workload at four seeds (distinct
# prompts), then bare batch_generate: runs_on_one_server.py. /tmp/site: MLX's CUDA wheels.
export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD
M=/tmp/bench-models/llama-1b-vocab49152
mkdir -p /tmp/bench-models
[ -d $M ] || python3 -m bench.models $M --shape llama-1b --dtype bfloat16 --tokenizer-from /tmp/stage/smol > /dev/null 2>&1
python3 -m server --model $M --port 8500 --disk-cache-bytes 0 --max-batch-size 64 --log-level debug > /tmp/bdw.log 2>&1 &
for i in $(seq 180); do curl -sf localhost:8500/health > /dev/null && break; sleep 1; done
python3 bench/experiments/batch-decode-64-1b/runs_on_one_server.py $M http://127.0.0.1:8500 /tmp/bdw.log
pkill -f "port 8500"; sleep 2
python3 -m bench.raw_batch $M batch_decode --shapes '{"bd_streams": 64, "bd_prompt_tokens": 64, "bd_output_tokens": 128}'
