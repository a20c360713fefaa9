"""Would compiling a classify read forward (`mx.compile`) shorten it? A read step's
forward is rebuilt in Python every step (the graph, ~2.3 ms of a 64-row list's ~11 ms on
an H200) and is launch-bound on MLX's CUDA backend; a compiled function replays its
graph without the model's Python, and fuses elementwise ops into fewer kernels.

    python bench/experiments/compiled-read-forward/measure.py MODEL_DIR

For 64, 128 and 256 rows of 17 new tokens after a 48-token preamble (the benchmark's
classify text), the preamble's KV tiled per row, the head at each row's last position:
the engine's layout (BatchKVCache, an array mask), the same with MLX's "causal" mask
(`engine_causal`; added after the H200 run) and mlx-lm's single-cache one (a causal
mask, no array), each plain and compiled. Per variant, medians of 20 after 3
untimed: `build` (the lazy graph made) and `total` (built and evaluated), in ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

NEW, PREAMBLE, REPEATS = 17, 48, 20


def head(model, hidden: mx.array) -> mx.array:
    if getattr(model, "lm_head", None) is not None:
        return model.lm_head(hidden)
    return model.model.embed_tokens.as_linear(hidden)


def read(model, tokens: mx.array, cache: list) -> mx.array:
    hidden = model.model(tokens, cache=cache)[:, -1:]
    logits = head(model, hidden)[:, 0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    best = mx.argmax(logprobs, axis=-1)
    return mx.stack([best.astype(mx.float32),
                     mx.take_along_axis(logprobs, best[:, None], axis=-1)[:, 0]])


def batch_caches(keys: list[mx.array], values: list[mx.array]) -> list:
    caches = []
    for k, v in zip(keys, values):
        rows, heads, length, dim = k.shape
        cache = BatchKVCache([0] * rows)
        cache.keys = mx.zeros((rows, heads, length + NEW, dim), k.dtype)
        cache.values = mx.zeros((rows, heads, length + NEW, dim), v.dtype)
        cache.keys[..., :length, :] = k
        cache.values[..., :length, :] = v
        cache.offset = cache.offset + length
        cache._idx = length
        caches.append(cache)
    return caches


class Causal:
    """A batch cache layer whose forward is masked by MLX's "causal" (no row is left-padded
    here): the engine's layout with the single cache's mask."""

    def __init__(self, layer) -> None:
        self._layer = layer

    def make_mask(self, n, return_array=False, window_size=None, **kwargs):
        return "causal"

    def __getattr__(self, name):
        return getattr(self._layer, name)


def single_caches(keys: list[mx.array], values: list[mx.array]) -> list:
    caches = []
    for k, v in zip(keys, values):
        cache = KVCache()
        cache.update_and_fetch(k, v)
        caches.append(cache)
    return caches


def timed(function, *args) -> dict[str, float]:
    for _ in range(3):
        mx.eval(function(*args))
    builds, totals = [], []
    for _ in range(REPEATS):
        start = time.perf_counter()
        out = function(*args)
        built = time.perf_counter()
        mx.eval(out)
        end = time.perf_counter()
        builds.append(1000 * (built - start))
        totals.append(1000 * (end - start))
    return {"build": round(statistics.median(builds), 3),
            "total": round(statistics.median(totals), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rows", default="64,128,256")
    args = parser.parse_args()
    model, _ = load(args.model)
    vocab = model.args.vocab_size
    preamble = mx.random.randint(1000, vocab, (1, PREAMBLE), key=mx.random.key(0))
    cache = make_prompt_cache(model)
    model(preamble, cache=cache)
    mx.eval([c.state for c in cache])
    results = {}
    for rows in map(int, args.rows.split(",")):
        keys = [mx.repeat(c.keys[..., :PREAMBLE, :], rows, axis=0) for c in cache]
        values = [mx.repeat(c.values[..., :PREAMBLE, :], rows, axis=0) for c in cache]
        tokens = mx.random.randint(1000, vocab, (rows, NEW), key=mx.random.key(rows))
        mx.eval(keys, values, tokens)

        def engine_layout(t, k, v):
            return read(model, t, batch_caches(k, v))

        def engine_causal(t, k, v):
            return read(model, t, [Causal(c) for c in batch_caches(k, v)])

        def single_layout(t, k, v):
            return read(model, t, single_caches(k, v))

        reference = engine_layout(tokens, keys, values)
        variants = {"engine": engine_layout, "engine_compiled": mx.compile(engine_layout),
                    "engine_causal": engine_causal,
                    "single": single_layout, "single_compiled": mx.compile(single_layout)}
        row = {}
        for name, function in variants.items():
            out = function(tokens, keys, values)
            same = bool(mx.all(out[0] == reference[0]).item())
            row[name] = {**timed(function, tokens, keys, values), "same_tokens": same}
        results[rows] = row
        print(json.dumps({"rows": rows, **row}), flush=True)
    print(json.dumps({"device": str(mx.default_device()), "new": NEW, "preamble": PREAMBLE,
                      "results": results}))


if __name__ == "__main__":
    main()
