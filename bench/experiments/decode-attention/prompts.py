"""Prompt attention (queries longer than one token) under a mask: MLX's fused SDPA with
cuDNN off (the server's default: MLX's unfused fallback), with cuDNN on, and the fold of
engine/attention.py generalised to longer queries, which the engine does not use yet:
does folding pay for prompts when cuDNN is off?

    MLX_CUDA_USE_CUDNN_SDPA=0 python bench/experiments/decode-attention/prompts.py
    MLX_CUDA_USE_CUDNN_SDPA=1 python bench/experiments/decode-attention/prompts.py

Llama-1B's attention (32 query heads, 8 KV heads, head dim 64), bfloat16, 16 layers.
"""

import json
import os
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
from attention import DIM, inputs, timed

SHAPES = [(16, 5, 1024), (1, 64, 6064), (1, 512, 2048), (1, 2048, 2048), (8, 200, 1400),
          (4, 200, 2200)]


def folded_prompt(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array
                  ) -> mx.array:
    rows, heads, length, dim = q.shape
    repeats = heads // k.shape[1]
    q = (q * mx.array(scale, q.dtype)).reshape(rows, k.shape[1], repeats * length, dim)
    scores = (q @ k.swapaxes(-1, -2)).reshape(rows, k.shape[1], repeats, length, -1)
    scores = mx.where(mask[:, :, None], scores,
                      mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    weights = mx.softmax(scores, axis=-1, precise=True)
    out = weights.reshape(rows, k.shape[1], repeats * length, -1) @ v
    return out.reshape(rows, heads, length, dim)


def measure(rows: int, length: int, context: int, layers: int = 16) -> dict:
    scale = DIM ** -0.5
    q, k, v, mask = inputs(rows, length, context, layers)
    sdpa = mx.fast.scaled_dot_product_attention
    fused = sdpa(q[0], k[0], v[0], scale=scale, mask=mask)
    row = {"cudnn": os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "default"), "rows": rows,
           "query": length, "context": context,
           "fused_mask_ms": timed(lambda i: sdpa(q[i], k[i], v[i], scale=scale, mask=mask),
                                  layers),
           "folded_ms": timed(lambda i: folded_prompt(q[i], k[i], v[i], scale, mask), layers),
           "folded_max_diff": float(mx.abs(folded_prompt(q[0], k[0], v[0], scale, mask)
                                           - fused).max())}
    if rows == 1:
        row["fused_causal_ms"] = timed(
            lambda i: sdpa(q[i], k[i], v[i], scale=scale, mask="causal"), layers)
    return row


def main() -> None:
    for shape in SHAPES:
        row = measure(*shape)
        print(json.dumps({key: round(value, 3) if isinstance(value, float) else value
                          for key, value in row.items()}), flush=True)


if __name__ == "__main__":
    main()
