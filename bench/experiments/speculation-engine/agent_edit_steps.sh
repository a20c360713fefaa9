#!/usr/bin/env bash
# The agent edit workload (bench/speculation.py) on the real SmolLM2 in bfloat16 through
# HTTP, with each server's step trace (RADIX_MLX_LOG_LEVEL=debug: a step's rows, how many
# of them verified, its milliseconds), then the verify step's parts in process
# (verify_parts.py): where a batch of 16 edits spends its steps.
#   bash bench/experiments/speculation-engine/agent_edit_steps.sh SMOLLM2.gguf OUT
set -euo pipefail
gguf=$1 out=$2
model=/tmp/smollm2-bf16
[ -d "$model" ] || python -m server.launch.cli convert "$gguf" "$model" --dtype bfloat16
RADIX_MLX_LOG_LEVEL=debug python -m bench --model "$model" --workloads agent_edit \
  --servers radix-mlx --no-structured --no-plots --out "$out"
python bench/experiments/speculation-engine/verify_parts.py "$model" --agent-edit \
  --stream-tokens 192 > "$out/verify-parts.json"
