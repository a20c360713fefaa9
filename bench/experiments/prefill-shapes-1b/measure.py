"""Where a short prompt's forward goes on a GPU: a question of 45 tokens over a cached
6,000-token document cost bare mlx-lm 9.9 ms on an H200 against 3.4 ms for a decode step,
and its attention only ~3.5 ms of the difference. This times, for M query tokens:
the Llama-1B shape's 112 projection matmuls alone (a chain, as a forward runs them), the
whole model's forward over no cache, and over a 6,000-token cache (trimmed back after
each), and the attention alone over that cache (mlx-lm's call, MLX's unfused fallback
with cuDNN off as the server runs), in bfloat16. One JSON line per figure, medians of 20
after 5 untimed. Token counts: the arguments, or SIZES.

    python bench/experiments/prefill-shapes-1b/measure.py [M ...] > out.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.models import base, llama
from mlx_lm.models.cache import make_prompt_cache

HIDDEN, LAYERS, HEADS, KV_HEADS, MLP, VOCAB = 2048, 16, 32, 8, 8192, 49152
CONTEXT = 6000
SIZES = (1, 2, 4, 8, 16, 32, 45, 48, 64, 96, 128, 256)


def median_ms(run, repeats: int = 20) -> float:
    for _ in range(5):
        mx.eval(run())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(run())
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 3)


def projections() -> list[tuple[mx.array, ...]]:
    shapes = [(HIDDEN, HIDDEN), (HIDDEN // HEADS * KV_HEADS, HIDDEN),
              (HIDDEN // HEADS * KV_HEADS, HIDDEN), (HIDDEN, HIDDEN), (MLP, HIDDEN),
              (MLP, HIDDEN), (HIDDEN, MLP)]
    layers = [tuple((mx.random.normal(s) * 0.02).astype(mx.bfloat16) for s in shapes)
              for _ in range(LAYERS)]
    mx.eval(layers)
    return layers


def chain(x: mx.array, layers) -> list[mx.array]:
    """The hidden state through every layer's projections, and the keys and values."""
    kv = []
    for wq, wk, wv, wo, wg, wu, wd in layers:
        kv += [x @ wk.T, x @ wv.T]
        x = x + (x @ wq.T) @ wo.T
        x = x + (x @ wg.T * (x @ wu.T)) @ wd.T
    return [x, *kv]


def main() -> None:
    sizes = [int(arg) for arg in sys.argv[1:]] or SIZES
    layers = projections()
    for m in sizes:
        x = mx.random.normal((1, m, HIDDEN)).astype(mx.bfloat16)
        print(json.dumps({"what": "112 matmuls", "tokens": m,
                          "ms": median_ms(lambda x=x: chain(x, layers))}), flush=True)
    args = llama.ModelArgs(model_type="llama", hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                           intermediate_size=MLP, num_attention_heads=HEADS,
                           num_key_value_heads=KV_HEADS, rms_norm_eps=1e-5, vocab_size=VOCAB,
                           tie_word_embeddings=True, head_dim=HIDDEN // HEADS)
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    for m in sizes:
        tokens = mx.random.randint(0, VOCAB, (1, m))
        print(json.dumps({"what": "forward, no cache", "tokens": m,
                          "ms": median_ms(lambda tokens=tokens: model(tokens))}), flush=True)
    cache = make_prompt_cache(model)
    document = mx.random.randint(0, VOCAB, (1, CONTEXT))
    for start in range(0, CONTEXT, 2048):
        model(document[:, start:start + 2048], cache=cache)
        mx.eval([c.state for c in cache])

    def over_cache(tokens: mx.array) -> mx.array:
        logits = model(tokens, cache=cache)[:, -1]
        mx.eval(logits)
        for layer in cache:
            layer.trim(tokens.shape[1])
        return logits

    first = cache[0]
    keys, values = (x[..., :first.offset, :] for x in (first.keys, first.values))
    for m in sizes:
        tokens = mx.random.randint(0, VOCAB, (1, m))
        print(json.dumps({"what": f"forward over {CONTEXT} cached", "tokens": m,
                          "ms": median_ms(lambda tokens=tokens: over_cache(tokens))}), flush=True)
        queries = mx.random.normal((1, HEADS, m, HIDDEN // HEADS)).astype(mx.bfloat16)
        print(json.dumps({"what": f"attention over {CONTEXT}, {LAYERS} layers", "tokens": m,
                          "ms": median_ms(lambda queries=queries: [base.scaled_dot_product_attention(
                              queries, keys, values, None, scale=0.125, mask="causal")
                              for _ in range(LAYERS)])}), flush=True)


if __name__ == "__main__":
    main()
