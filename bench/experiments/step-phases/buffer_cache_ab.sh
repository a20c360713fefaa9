# The 8B multi-turn workload, radix-mlx alone, with MLX's buffer cache kept after each
# prefill (`STEP_PHASES_NO_CLEAR=1`: `mx.clear_cache` a no-op) and then released as the
# engine does, each with the step trace and the parts of slow steps in its server log
# (issue 36; results in bench/results/nvidia-h200/multi-turn-8b-vocab49152/buffer-cache-ab):
#   bash buffer_cache_ab.sh OUT   (on the GPU machine; MLX and the wheels in /tmp/site,
#                                  the SmolLM2 tokenizer in /tmp/stage/smol)
OUT=${1:?output folder}
HERE=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH=$HERE:/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
export STEP_PHASES_MIN_MS=100 RADIX_MLX_LOG_LEVEL=debug BENCH_TOKENIZER=/tmp/stage/smol
export BENCH_WORKLOADS=multi_turn BENCH_KEEP_MODELS=1
export BENCH_ARGS='--no-structured --rounds 2 --servers radix-mlx'
mkdir -p "$OUT"
for variant in kept released; do
  if [ $variant = kept ]; then export STEP_PHASES_NO_CLEAR=1; else unset STEP_PHASES_NO_CLEAR; fi
  timeout 235 bash bench/gpu.sh "$OUT/$variant" llama-8b > "$OUT/$variant.log" 2>&1
  echo "$variant rc=$?"
done
