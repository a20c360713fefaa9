"""Do MLX's CUDA graphs cost a prompt step only the first time its graphs' topology is met?

    for cycle in 1 2; do for graphs in 1 0; do
      MLX_USE_CUDA_GRAPHS=$graphs MLX_CUDA_USE_CUDNN_SDPA=0 \
        python bench/experiments/cuda-graphs-turns/turns.py MODEL_DIR
    done; done

The engine turns MLX's CUDA graphs off (engine/platform_info.py), because a multi-turn
turn's step over its cached chat took 90-95 ms with them and 62-68 ms without on an H200
(8B shape). That costs single-stream decode, which is launch-bound: with graphs off the
server's step launches its ~300 kernels one by one (bench/results/nvidia-h200/
llama-1b-vocab49152-at-004155a, decode parity 0.72x bare). MLX keys its executable
graphs by topology (node kinds and dependencies), not by shapes, and updates a cached one
in place when only the kernels' parameters differ (mlx/backend/cuda/device.cpp,
`CommandEncoder::commit`). If a turn's cost is a topology met for the first time, a
warm-up over prompt lengths would take it away, and graphs could stay on.

Each setting runs in a process of its own (MLX reads MLX_USE_CUDA_GRAPHS once), cuDNN's
attention off as the server runs it (it builds a plan per new shape). A run caches a
BASE-token prompt, then times, each forward evaluated alone (wall and process CPU, ms):
- `first`: turns of 16 lengths between 40 and 300 tokens over that cache, each length
  met for the first time;
- `again`: the same 16 lengths again;
- `other`: 16 other lengths in the same range, met for the first time;
- `decode`: 64 one-token steps over the cache.
After each forward the cache is trimmed back to BASE tokens. Prints one JSON line.
"""

import json
import os
import random
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

BASE = 1500
TURNS = 16


def main(model: str) -> dict:
    lm, _ = load(model)
    vocab = lm.args.vocab_size
    rng = random.Random(0)
    cache = make_prompt_cache(lm)
    mx.eval(lm(mx.array([[rng.randrange(vocab) for _ in range(BASE)]]), cache=cache))

    def forward(length: int) -> tuple[float, float]:
        tokens = mx.array([[rng.randrange(vocab) for _ in range(length)]])
        mx.eval(tokens)
        wall, cpu = time.perf_counter(), time.process_time()
        mx.eval(lm(tokens, cache=cache))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        for layer in cache:
            layer.trim(length)
        return 1e3 * wall, 1e3 * cpu

    lengths = rng.sample(range(40, 301), 2 * TURNS)
    first, other = lengths[:TURNS], lengths[TURNS:]
    for _ in range(3):  # the kernels themselves, compiled once per process
        forward(first[0] + 1)
        forward(1)
    result: dict = {"setting": "graphs " + ("off" if os.environ.get(
        "MLX_USE_CUDA_GRAPHS") == "0" else "on")}
    for name, pass_lengths in (("first", first), ("again", first), ("other", other),
                               ("decode", [1] * 64)):
        runs = [forward(n) for n in pass_lengths]
        result[name] = {"wall_ms": round(statistics.median(r[0] for r in runs), 2),
                        "cpu_ms": round(statistics.median(r[1] for r in runs), 2),
                        "max_wall_ms": round(max(r[0] for r in runs), 2)}
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
