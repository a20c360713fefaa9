"""Decode attention over a left-padded batch: what MLX's fused SDPA costs with the batch's
boolean mask (MLX's CUDA vector kernel takes no array mask, so it falls back to unfused
ops), without any mask (the kernel's own floor), and folded (engine/attention.py: a KV
head's query heads as rows of one batched matmul, no broadcast over the repeats).

    python bench/experiments/decode-attention/attention.py [--layers 16]

Llama-1B's attention shape (32 query heads, 8 KV heads, head dim 64), bfloat16; per
(rows, query length, context) the median of 20 timed runs of `layers` attentions
evaluated together, and the largest difference between folded and fused.
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable

import mlx.core as mx

from engine.attention import folded_attention

HEADS, KV_HEADS, DIM = 32, 8, 64
SHAPES = [(64, 1, 192), (64, 1, 1024), (64, 1, 2304), (16, 1, 2304), (64, 1, 4096)]


def timed(attend: Callable[[int], mx.array], layers: int, repeats: int = 20) -> float:
    for _ in range(3):
        mx.eval([attend(i) for i in range(layers)])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval([attend(i) for i in range(layers)])
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def inputs(rows: int, length: int, context: int, layers: int, slack: int = 0
           ) -> tuple[list[mx.array], list[mx.array], list[mx.array], mx.array]:
    """Per layer: queries, keys and values in bfloat16 (keys and values sliced from buffers
    `slack` tokens longer, as BatchKVCache returns them); a boolean mask, causal over the
    last `length` positions, with each row's random left padding."""

    def normal(shape: tuple[int, ...]) -> mx.array:
        return mx.random.normal(shape).astype(mx.bfloat16)

    q = [normal((rows, HEADS, length, DIM)) for _ in range(layers)]
    k = [normal((rows, KV_HEADS, context + slack, DIM))[..., :context, :]
         for _ in range(layers)]
    v = [normal((rows, KV_HEADS, context + slack, DIM))[..., :context, :]
         for _ in range(layers)]
    pad = (mx.random.randint(0, context // 4, (rows,)) if rows > 1
           else mx.zeros((1,), mx.int32))
    causal = mx.arange(context - length, context)[:, None] >= mx.arange(context)[None]
    mask = causal[None, None] & (mx.arange(context)[None] >= pad[:, None])[:, None, None]
    mx.eval(q, k, v, mask)
    return q, k, v, mask


def measure(rows: int, length: int, context: int, layers: int) -> dict:
    """One shape's timings; `length` is 1 (engine/attention.py folds only one-token
    queries: for prompts the first version of this script found folding slower)."""
    scale = DIM ** -0.5
    q, k, v, mask = inputs(rows, length, context, layers, slack=256)
    sdpa = mx.fast.scaled_dot_product_attention
    fused = sdpa(q[0], k[0], v[0], scale=scale, mask=mask)
    return {
        "rows": rows, "query": length, "context": context,
        "fused_bool_mask_ms": timed(lambda i: sdpa(q[i], k[i], v[i], scale=scale, mask=mask),
                                    layers),
        "fused_no_mask_ms": timed(lambda i: sdpa(q[i], k[i], v[i], scale=scale), layers),
        "folded_ms": timed(lambda i: folded_attention(q[i], k[i], v[i], scale, mask), layers),
        "folded_max_diff": float(mx.abs(folded_attention(q[0], k[0], v[0], scale, mask)
                                        - fused).max()),
        "kv_gb": 2 * rows * KV_HEADS * context * DIM * 2 * layers / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()
    for shape in SHAPES:
        row = measure(*shape, args.layers)
        print(json.dumps({key: round(value, 3) if isinstance(value, float) else value
                          for key, value in row.items()}), flush=True)


if __name__ == "__main__":
    main()
