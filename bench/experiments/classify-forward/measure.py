"""A classify list's forward alone, by how its rows are laid out: is the 64 x 17-token
group forward slow for its FLOPs, and what would a packed layout cost?

    python bench/experiments/classify-forward/measure.py MODEL_DIR

mlx-lm's model, synchronized, median of 20 after 3 untimed (ms), each ending in the last
positions' log-softmax and argmax as classify reads them:
- `batch_cached`: 64 rows x 17 new tokens after a 48-token preamble, the preamble's KV
  tiled per row (what the engine's group forward computes);
- `batch_cold`: 64 rows x 65 tokens, no cache (bare `batch_generate`'s forward);
- `packed`: one row of 64 x 17 tokens, causal, no cache (the GEMMs of the new tokens
  alone, with one attention over all of them: a lower bound for a packed layout);
- `decode64`: 64 rows x 1 token after 65 cached (a decode step, for scale).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

ROWS, NEW, PREAMBLE, REPEATS = 64, 17, 48, 20


def timed(function) -> float:
    for _ in range(3):
        mx.eval(function())
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        mx.eval(function())
        times.append(1000 * (time.perf_counter() - start))
    return round(statistics.median(times), 3)


def read(logits: mx.array) -> mx.array:
    last = logits[:, -1].astype(mx.float32)
    return mx.argmax(last - mx.logsumexp(last, axis=-1, keepdims=True), axis=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    args = parser.parse_args()
    model, _ = load(args.model)
    vocab = model.args.vocab_size
    key = mx.random.key(0)
    preamble = mx.random.randint(1000, vocab, (1, PREAMBLE), key=key)
    sentences = mx.random.randint(1000, vocab, (ROWS, NEW), key=mx.random.key(1))

    def tiled_cache():
        cache = make_prompt_cache(model)
        model(preamble, cache=cache)
        for c in cache:
            c.keys = mx.repeat(c.keys[..., :c.offset, :], ROWS, axis=0)
            c.values = mx.repeat(c.values[..., :c.offset, :], ROWS, axis=0)
        return cache

    def batch_cached():
        return read(model(sentences, cache=tiled_cache()))

    cold = mx.concatenate([mx.repeat(preamble, ROWS, axis=0), sentences], axis=1)
    decode_cache = make_prompt_cache(model)
    model(cold, cache=decode_cache)
    mx.eval([c.state for c in decode_cache])

    def decode64():
        out = read(model(sentences[:, :1], cache=decode_cache))
        for c in decode_cache:
            c.trim(1)
        return out

    results = {
        "batch_cached": timed(batch_cached),
        "batch_cached_tiling_only": timed(lambda: [c.state for c in tiled_cache()]),
        "batch_cold": timed(lambda: read(model(cold))),
        "packed": timed(lambda: read(model(sentences.reshape(1, -1)))),
        "decode64": timed(decode64),
    }
    print(json.dumps({"device": str(mx.default_device()), "rows": ROWS, "new": NEW,
                      "preamble": PREAMBLE, "median_ms": results}))


if __name__ == "__main__":
    main()
