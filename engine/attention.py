"""Attention wherever MLX would run its unfused fallback: a masked one-token query off
Metal, and every query on the CPU.

mlx-lm's BatchKVCache left-pads its rows to a common length and masks the padding with a
boolean array. MLX's fused attention takes no array mask for a one-token query on CUDA
(nor anything on the CPU), so every decode step of a batch fell back to MLX's unfused
ops, which broadcast each KV head over its query heads inside the matmul. MLX runs that
broadcast matmul far below the memory's speed: on an H200, Llama-1B's attention over 64
rows of 2,304 tokens took 18.7 ms for 16 layers, against 1.8 ms for the fused kernel
with no mask. Folding a KV head's query heads into the rows of one batched matmul
computes the same ops in the same precision in 3.2 ms, and 1.7x faster on a CPU
(bench/experiments/decode-attention). Metal's fused kernel takes the mask itself.

On the CPU, queries with many scores take the folded ops with engine.cpu_math's softmax
(MLX's own spends most of a prompt's attention in `exp` there; that module says how
much), a block of queries at a time: glibc serves a buffer over 32 MB with fresh pages,
whose faults made a prompt's scores 2.5x slower to exponentiate. Over 1,024 cached tokens
512 queries of the `bench` model attended in 119 ms a layer in blocks of 8 MB of scores,
280 ms in one, and 267 ms through MLX's fallback (bench/experiments/cpu-exp).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.core as mx
from mlx_lm.models import base

from engine import cpu_math

SOFTMAX = partial(mx.softmax, axis=-1, precise=True)  # MLX's, as its fallback runs it
# The most float32 scores one block of a CPU attention computes at once.
BLOCK_BYTES = 8 * 2**20


def scaled_dot_product_attention(queries: mx.array, keys: mx.array, values: mx.array,
                                 cache: Any, scale: float, mask: Any,
                                 sinks: mx.array | None = None) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention`, folded where MLX would not fuse it."""
    if sinks is None and not hasattr(cache, "bits"):
        if mx.default_device() == mx.cpu and _scores(queries, keys) >= cpu_math.SMALL:
            return cpu_attention(queries, keys, values, scale, mask)
        if isinstance(mask, mx.array) and queries.shape[2] == 1:
            return folded_attention(queries, keys, values, scale, mask)
    return base.scaled_dot_product_attention(queries, keys, values, cache, scale=scale,
                                             mask=mask, sinks=sinks)


def folded_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                     mask: mx.array | str | None,
                     softmax: Callable[[mx.array], mx.array] = SOFTMAX) -> mx.array:
    """Queries (B, H, L, D) over keys and values (B, KV heads, T, D) under `mask` (None,
    "causal" as MLX reads it: the queries are the last L of the T positions, or an array,
    boolean or additive, broadcastable to (B, H, L, T)): MLX's fallback, with each KV
    head's query heads as rows of one matmul rather than a broadcast batch dimension."""
    batch, heads, length, dim = queries.shape
    kv_heads, total = keys.shape[1], keys.shape[2]
    repeats = heads // kv_heads
    q = (queries * mx.array(scale, queries.dtype)).reshape(batch, kv_heads, repeats * length,
                                                           dim)
    scores = (q @ keys.swapaxes(-1, -2)).reshape(batch, kv_heads, repeats, length, total)
    if isinstance(mask, str):
        mask = _causal(total - length, total, total)
    if mask is not None:
        scores = _masked(scores, _per_kv_head(mask, heads, kv_heads))
    weights = softmax(scores).reshape(batch, kv_heads, repeats * length, total)
    return (weights @ values).reshape(batch, heads, length, dim)


def cpu_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                  mask: mx.array | str | None) -> mx.array:
    """`folded_attention` on the CPU with engine.cpu_math's softmax, over blocks of
    queries whose scores take at most BLOCK_BYTES."""
    length = queries.shape[2]
    block = max(1, BLOCK_BYTES // (4 * (_scores(queries, keys) // length)))
    if block >= length:
        return folded_attention(queries, keys, values, scale, mask, cpu_math.softmax)
    outputs = []
    for start in range(0, length, block):
        end = min(start + block, length)
        outputs.append(folded_attention(queries[:, :, start:end], keys, values, scale,
                                        _rows(mask, start, end, length, keys.shape[2]),
                                        cpu_math.softmax))
    return mx.concatenate(outputs, axis=2)


def _scores(queries: mx.array, keys: mx.array) -> int:
    """How many scores the queries' attention computes."""
    return queries.shape[0] * queries.shape[1] * queries.shape[2] * keys.shape[2]


def _rows(mask: mx.array | str | None, start: int, end: int, length: int, total: int
          ) -> mx.array | None:
    """The part of `mask` (of queries [0, length) over `total` keys) that queries
    [start, end) take."""
    if isinstance(mask, str):  # "causal": the queries are the last `length` positions
        first = total - length
        return _causal(first + start, first + end, total)
    if mask is None or mask.ndim < 2 or mask.shape[-2] == 1:
        return mask
    return mask[..., start:end, :]


def _causal(first: int, end: int, total: int) -> mx.array:
    """MLX's "causal" for the queries at positions [first, end) over `total` keys."""
    return mx.arange(first, end)[:, None] >= mx.arange(total)[None]


def _per_kv_head(mask: mx.array, heads: int, kv_heads: int) -> mx.array:
    """A mask broadcastable to (B, H, L, T) as one broadcastable to (B, KV heads,
    repeats, L, T)."""
    if mask.ndim == 4:
        if mask.shape[1] == heads:
            return mask.reshape(mask.shape[0], kv_heads, heads // kv_heads, *mask.shape[2:])
        return mask[:, :, None]
    if mask.ndim == 3 and mask.shape[0] == heads:
        return mask.reshape(kv_heads, heads // kv_heads, *mask.shape[1:])
    return mask


def _masked(scores: mx.array, mask: mx.array) -> mx.array:
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    return scores + mask
