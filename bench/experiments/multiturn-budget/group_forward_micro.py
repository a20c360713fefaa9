"""Several prompts' new tokens in one padded forward against one forward each, on caches
that already hold ~300 tokens (different lengths when together, as radix hits are).

    LD_PRELOAD=.../libblas.so.3 python group_forward_micro.py MODEL_DIR
"""

import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from engine.mlx_lm_internals import merge_caches

model, _ = load(sys.argv[1])


def cache_with(prefix: int) -> list:
    cache = make_prompt_cache(model)
    model(mx.array([list(range(1, prefix + 1))]), cache=cache)
    mx.eval([layer.state for layer in cache])
    return cache


def one_by_one(n: int, rows: int, prefix: int) -> tuple[float, float]:
    caches = [cache_with(prefix) for _ in range(rows)]
    cpu, wall = time.process_time(), time.perf_counter()
    for cache in caches:
        model(mx.array([list(range(5, 5 + n))]), cache=cache)
        mx.eval([layer.state for layer in cache])
    return time.process_time() - cpu, time.perf_counter() - wall


def together(n: int, rows: int, prefix: int) -> tuple[float, float]:
    caches = [cache_with(prefix + 7 * i) for i in range(rows)]
    cpu, wall = time.process_time(), time.perf_counter()
    cache = merge_caches(caches)
    out = model(mx.array([list(range(5, 5 + n))] * rows), cache=cache)
    mx.eval(out[:, -1], [layer.state for layer in cache])
    return time.process_time() - cpu, time.perf_counter() - wall


for n, rows, prefix in [(256, 4, 300), (140, 4, 300), (128, 4, 300), (256, 2, 300)]:
    for way in (one_by_one, together, one_by_one, together):
        cpu, wall = way(n, rows, prefix)
        print(f"{way.__name__:10s} rows={rows} n={n} prefix={prefix}: "
              f"cpu {cpu:.2f}s wall {wall:.2f}s", flush=True)
