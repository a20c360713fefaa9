"""Every use of mlx-lm's internals, in one module, so an mlx-lm upgrade is one file's review.

mlx-lm's public API covers loading, models and per-sequence caches; batching caches of
different lengths together, copying a row out of a batch, and building a cache from
arrays we hold reach into its cache classes' fields. Everything here does, and nothing
else in the engine does: elsewhere a cache is a list of layers passed to the model.
Snapshots use the caches' public `state` and `from_state` (what mlx-lm's own
save/load_prompt_cache use), so every cache type mlx-lm has can be copied.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm.generate import _merge_caches
from mlx_lm.models import activations, base
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from engine import attention, cpu_math


def owned(x: mx.array) -> mx.array:
    """A copy of `x` in its own buffer: a slice would keep the whole buffer alive."""
    return mx.contiguous(x)


def supports_segments(cache: Sequence[Any]) -> bool:
    """Whether a model's cache is all plain KV, so prefixes can be shared at any token."""
    return all(type(c) is KVCache for c in cache)


def kv_span(layer: KVCache, start: int, end: int) -> tuple[mx.array, mx.array]:
    """Owned copies of a single-sequence KV layer's keys and values for [start, end)."""
    return owned(layer.keys[..., start:end, :]), owned(layer.values[..., start:end, :])


def clone_cache(cache: Sequence[Any]) -> list[Any]:
    """Per-layer copies of `cache` that share no array object with it: mlx-lm caches
    update with `array[...] = x`, which mutates the Python array object in place."""
    return [type(layer).from_state(_copy_arrays(layer.state)) for layer in cache]


def _copy_arrays(value: Any) -> Any:
    if isinstance(value, mx.array):
        return owned(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_copy_arrays(v) for v in value)
    return value


def use_engine_kernels(model: nn.Module) -> None:
    """Off Metal, give the mlx-lm modules `model` is built from engine.attention's
    `scaled_dot_product_attention`, and `swiglu` below (their docstrings say why). They
    import mlx-lm's by name, so the names are rebound in each: for every model of those
    modules in this process."""
    if mx.metal.is_available():
        return
    for name in {type(module).__module__ for module in model.modules()}:
        module = sys.modules.get(name)
        if getattr(module, "scaled_dot_product_attention", None) is base.scaled_dot_product_attention:
            module.scaled_dot_product_attention = attention.scaled_dot_product_attention
        if getattr(module, "swiglu", None) is activations.swiglu:
            module.swiglu = swiglu


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's `swiglu`, on the CPU with engine.cpu_math's, whose `exp` vectorises."""
    if mx.default_device() == mx.cpu and gate.size >= cpu_math.SMALL:
        return cpu_math.swiglu(gate, x)
    return activations.swiglu(gate, x)


def cache_arrays(cache: Sequence[Any]) -> list[Any]:
    """What to evaluate to materialize a cache."""
    return [layer.state for layer in cache]


def merge_caches(caches: list[list[Any]]) -> list[Any]:
    """Single-sequence caches as one batch cache, left-padded to a common length."""
    return _merge_caches(caches)


# Tokens of a cached prefix: keys and values of every layer, as a list of per-layer
# arrays ([1, heads, >= tokens, dim]) or one array stacked over layers ([layers, 1, heads,
# >= tokens, dim]), and how many tokens of them, from the first.
Span = tuple[Sequence[mx.array] | mx.array, Sequence[mx.array] | mx.array, int]


def span_tokens(spans: Sequence[Span]) -> int:
    """How many tokens `spans` hold end to end."""
    return sum(n for _, _, n in spans)


def prefix_batch(prefixes: Sequence[Sequence[Span]], width: int, layers: int
                 ) -> list[BatchKVCache]:
    """A batch cache whose row i holds the spans `prefixes[i]` end to end, left-padded to
    the longest, with room for `width` more tokens: what `merge_caches` makes of
    single-sequence caches holding them, less its copies. The batch is written for all
    layers at once (one array stacked over layers, each layer's cache a view of it), and
    a span that consecutive rows have at the same place (the same arrays) is written with
    one copy for all of them: on an H100 each copy is a kernel launch, and a copy per
    layer, row and span took 15 ms to write seven 2000-token multi-turn prefixes
    (`grouped-prefill-1b`). Each layer's view is copied out whole by the forward's first
    write to it: one copy of the batch, where merging copies every row and the first
    write copies the whole batch again to grow it."""
    lengths = [span_tokens(spans) for spans in prefixes]
    longest = max(lengths)
    writes: list[list[Any]] = []  # [first row, end row, position, keys, values, tokens]
    last: dict[tuple[int, int, int], list[Any]] = {}
    for row, spans in enumerate(prefixes):
        position = longest - lengths[row]
        for keys, values, n in spans:
            write = last.get((position, id(keys), n))
            if write is not None and write[1] == row:
                write[1] = row + 1
            else:
                write = last[(position, id(keys), n)] = [row, row + 1, position, keys, values, n]
                writes.append(write)
            position += n
    batch = [BatchKVCache([longest - n for n in lengths]) for _ in range(layers)]
    if not writes:
        return batch  # the forward's first write sizes the buffer
    stacked: dict[tuple[int, int], mx.array] = {}  # per-layer arrays, stacked once

    def of_all_layers(arrays: Sequence[mx.array] | mx.array, n: int) -> mx.array:
        if isinstance(arrays, mx.array):
            return arrays[..., :n, :]
        if (id(arrays), n) not in stacked:
            stacked[(id(arrays), n)] = mx.stack([a[..., :n, :] for a in arrays])
        return stacked[(id(arrays), n)]

    # Exactly what the forward writes: each layer's view is copied whole by that write,
    # so room beyond it would be copied too (on the CPU, a classify list's 64 rows padded
    # to 256 positions made the copy cost 10% of its sentences/s); the first decode step
    # grows the buffer, as it grows any full one.
    capacity = longest + width
    # Layer 0's arrays, [1, heads, tokens, dim], whichever way the span holds them.
    keys0, values0 = writes[0][3][0], writes[0][4][0]
    keys = mx.zeros((layers, len(prefixes), keys0.shape[1], capacity, keys0.shape[3]),
                    keys0.dtype)
    values = mx.zeros((layers, len(prefixes), values0.shape[1], capacity, values0.shape[3]),
                      values0.dtype)
    for first, end, position, span_keys, span_values, n in writes:
        keys[:, first:end, :, position:position + n] = of_all_layers(span_keys, n)
        values[:, first:end, :, position:position + n] = of_all_layers(span_values, n)
    for layer, cache in enumerate(batch):
        cache.keys, cache.values = keys[layer], values[layer]
        cache.offset += longest
        cache._idx = longest
    return batch


def row_cache(cache: list[Any], row: int) -> list[Any]:
    """Row `row` of a batch cache as a single-sequence cache. Plain KV layers are copied
    into a presized buffer (`BatchKVCache.extract` gives an exact-size one, which the next
    token reallocates); every such layer has the same padding, so it is read back once."""
    padding = None
    single = []
    for layer in cache:
        if isinstance(layer, BatchKVCache):
            if padding is None:
                padding = layer.left_padding[row].item()
            single.append(presized_kv([layer.keys[row:row + 1, :, padding:layer._idx]],
                                      [layer.values[row:row + 1, :, padding:layer._idx]]))
        else:
            single.append(layer.extract(row))
    return single


def row_views(cache: list[Any], rows: Sequence[int]) -> list[list[Any]]:
    """Rows of a batch cache as single-sequence caches to read from (the tree's handles
    copy spans out of them): plain KV layers are slices of the batch's buffers, so taking
    a row out costs no copy; other layers are extracted. The padding, which every plain
    KV layer shares, is read back once for all rows."""
    paddings = None
    views: list[list[Any]] = [[] for _ in rows]
    for layer in cache:
        if not isinstance(layer, BatchKVCache):
            for view, row in zip(views, rows):
                view.append(layer.extract(row))
            continue
        if paddings is None:
            paddings = layer.left_padding.tolist()
        for view, row in zip(views, rows):
            single = KVCache()
            single.keys = layer.keys[row:row + 1, :, paddings[row]:layer._idx]
            single.values = layer.values[row:row + 1, :, paddings[row]:layer._idx]
            single.offset = layer._idx - paddings[row]
            view.append(single)
    return views


# The most row-tokens (rows x columns) one stack of a run of batch rows holds: the stack
# is a transient copy beside the handles copied out of it (64 sentences of ~20 tokens
# fit; 64 streams ending together after 1000 tokens each are stacked one by one, each
# stack then being the row's handle itself).
MAX_STACKED_TOKENS = 4096


class BatchRow:
    """Row `row` of a batch cache's plain KV layers, to copy token spans of from: the
    keys and values of every layer stacked in one array ([layers, rows, heads, tokens,
    dim], views shared by rows read together), so a span of all layers is one copy where
    a span per layer was a copy per layer (a kernel launch each on a GPU: a classify
    list's sentences each made 32 on a 16-layer model). Token t of the row is at column
    `offset + t`; tokens before `offset` are not there (`batch_rows`)."""

    def __init__(self, keys: mx.array, values: mx.array, row: int, offset: int) -> None:
        self.keys, self.values, self.row, self.offset = keys, values, row, offset

    def span(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        """Owned copies of tokens [start, end), [layers, 1, heads, tokens, dim]."""
        a, b = self.offset + start, self.offset + end
        if a < 0:
            raise ValueError(f"token {start} was not read from the batch")
        return (owned(self.keys[:, self.row:self.row + 1, :, a:b]),
                owned(self.values[:, self.row:self.row + 1, :, a:b]))


def batch_rows(cache: list[Any], rows: Sequence[int], firsts: Sequence[int]
               ) -> list[BatchRow] | None:
    """Rows of a batch cache to copy spans of from token `firsts[i]` of each on (lazily:
    what they read is copied when the spans are evaluated, before the batch is written
    again). Each run of consecutive rows is stacked over layers once, from the earliest
    column any of them needs (rows end together in a left-padded batch), up to
    `MAX_STACKED_TOKENS`. None unless every layer is plain KV."""
    if not all(type(layer) is BatchKVCache for layer in cache):
        return None
    paddings = cache[0].left_padding.tolist()  # every layer has the same padding
    end = cache[0]._idx
    found: dict[int, BatchRow] = {}
    runs: list[list[int]] = []
    columns = 0  # of the last run
    for i in sorted(range(len(rows)), key=lambda i: rows[i]):
        needed = end - paddings[rows[i]] - firsts[i]
        if runs and rows[i] == rows[runs[-1][-1]] + 1 and (
                len(runs[-1]) + 1) * max(columns, needed) <= MAX_STACKED_TOKENS:
            runs[-1].append(i)
            columns = max(columns, needed)
        else:
            runs.append([i])
            columns = needed
    for run in runs:
        top = rows[run[0]]
        low = min(paddings[rows[i]] + firsts[i] for i in run)
        keys = mx.stack([layer.keys[top:top + len(run), :, low:end] for layer in cache])
        values = mx.stack([layer.values[top:top + len(run), :, low:end] for layer in cache])
        for i in run:
            found[i] = BatchRow(keys, values, rows[i] - top, paddings[rows[i]] - low)
    return [found[i] for i in range(len(rows))]


def keep_rows(cache: list[Any], keep: list[int]) -> None:
    """Drop every row not in `keep` from a batch cache, in place.

    BatchKVCache's own `filter` gathers rows with an index array, which took 11 ms for 17
    rows of 2000 tokens on an H100; copying runs of kept rows as slices took 1.4 ms."""
    runs: list[tuple[int, int]] = []
    for row in keep:
        if runs and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    trim = None  # every plain KV layer has the same padding: read it back once
    for layer in cache:
        if not isinstance(layer, BatchKVCache) or layer.keys is None:
            layer.filter(keep)
            continue
        layer.keys = mx.concatenate([layer.keys[a:b] for a, b in runs])
        layer.values = mx.concatenate([layer.values[a:b] for a, b in runs])
        layer.offset = mx.concatenate([layer.offset[a:b] for a, b in runs])
        layer.left_padding = mx.concatenate([layer.left_padding[a:b] for a, b in runs])
        if trim is None:
            trim = min(layer.left_padding.tolist())
        if trim > 0:  # every row starts later: drop the shared padding
            layer.keys = layer.keys[..., trim:, :]
            layer.values = layer.values[..., trim:, :]
            layer._idx -= trim
            layer.left_padding -= trim


def drop_last(cache: list[Any], drops: Sequence[int], lengths: Sequence[int]) -> list[int]:
    """Roll back a verify step (speculative decoding): drop the last `drops[i]` tokens of
    each row of a plain KV cache, whose rows keep `lengths[i]` tokens. Returns how many of
    each row's first slots moved (below).

    A single sequence's cache is trimmed. A batch's rows share one write position, so a
    row that drops more than the others cannot just end earlier: every row is trimmed by
    the least any drops, and a row that drops `e` more hands its `e` rejected slots over
    to its first `e` tokens, moved there, and takes the `e` slots they left as left
    padding (RoPE offset down by `e`). A copy of `e` tokens per layer, where shifting the
    row right (mlx-lm's `finalize`) copies all of it at every step whose rows disagree.
    Attention does not depend on the order of the cached positions before the queries
    (each holds its own rotated key), but a copy out of the row does: the generator
    restores the order first (`restore_order`)."""
    if not isinstance(cache[0], BatchKVCache):
        for layer in cache:
            layer.trim(drops[0])
        return [0]
    common = min(drops)
    extra = [d - common for d in drops]
    moved = [min(e, n) for e, n in zip(extra, lengths)]
    paddings = cache[0].left_padding.tolist()
    rows: list[int] = []
    sources: list[int] = []
    targets: list[int] = []
    end = cache[0]._idx - common
    for row, m in enumerate(moved):
        rows += [row] * m
        sources += range(paddings[row], paddings[row] + m)
        targets += range(end - m, end)
    shift = mx.array(extra)
    row_of, source, target = mx.array(rows), mx.array(sources), mx.array(targets)
    for layer in cache:
        layer.trim(common)
        if rows:
            layer.keys[row_of, :, target] = layer.keys[row_of, :, source]
            layer.values[row_of, :, target] = layer.values[row_of, :, source]
        layer.left_padding = layer.left_padding + shift
        layer.offset = layer.offset - shift
    return moved


def restore_order(cache: list[Any], row: int, order: Sequence[int]) -> None:
    """Put a batch row's first `len(order)` tokens back in order: slot s after its left
    padding holds token `order[s]` (`drop_last` moved them)."""
    padding = cache[0].left_padding[row].item()
    where = mx.argsort(mx.array(order)) + padding
    span = slice(padding, padding + len(order))
    for layer in cache:
        layer.keys[row:row + 1, :, span] = layer.keys[row:row + 1, :, where]
        layer.values[row:row + 1, :, span] = layer.values[row:row + 1, :, where]


def presized_kv(keys: Sequence[mx.array], values: Sequence[mx.array]) -> KVCache:
    """A KVCache holding the concatenation of `keys`/`values` (each [1, heads, tokens,
    dim]) in a buffer rounded up to whole cache steps with room for one more token, so
    the next tokens are written in place instead of reallocating the buffer. (A buffer of
    whole steps also keeps CUDA's cuDNN decode kernel usable.)"""
    length = sum(k.shape[2] for k in keys)
    capacity = -(-(length + 1) // KVCache.step) * KVCache.step
    cache = KVCache()
    cache.keys = mx.zeros((*keys[0].shape[:2], capacity, keys[0].shape[3]), keys[0].dtype)
    cache.values = mx.zeros((*values[0].shape[:2], capacity, values[0].shape[3]),
                            values[0].dtype)
    start = 0
    for k, v in zip(keys, values):
        end = start + k.shape[2]
        cache.keys[..., start:end, :] = k
        cache.values[..., start:end, :] = v
        start = end
    cache.offset = length
    return cache


def causal_rows(cache: list[Any]) -> list[Any]:
    """A batch cache's layers for one forward in which no row is left-padded (rows over
    prefixes of one length; a row's right padding comes after its tokens, which never
    attend to it): masked by MLX's "causal", not the array of every row's padding
    BatchKVCache makes. MLX's CUDA backend runs the array mask's attention far slower: on
    an H200 a read of 64, 128 and 256 rows of 17 tokens over a 48-token preamble
    (Llama-1B shape) took 10.3, 15.8 and 27.2 ms with it, 8.9, 13.8 and 22.3 with "causal"
    (bench/results/nvidia-h200/compiled-read-forward-1b-vocab49152). On the CPU both are
    MLX's unfused ops, alike."""
    return [CausalRows(layer) for layer in cache]


class CausalRows:
    """A batch cache layer whose mask is "causal"; the rest is the layer's own."""

    def __init__(self, layer: Any) -> None:
        self._layer = layer

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None,
                  **kwargs: Any) -> Any:
        if return_array or window_size is not None:
            return self._layer.make_mask(n, return_array=return_array,
                                         window_size=window_size, **kwargs)
        return "causal"

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)


def rounded_writes(cache: list[Any], round: Callable[[mx.array], mx.array]) -> list[Any]:
    """`cache`'s layers, each keeping `round` of the keys and values a forward gives it:
    a quantized server's running cache holds only what its tree gives back (kv_quant.py).
    Every token attends over every other as kept, its own forward's included, so what a
    token sees does not depend on how its prompt was cut into forwards (chunks, a cache
    hit, a speculative step) beyond the float noise of their shapes."""
    return [RoundedWrites(layer, round) for layer in cache]


class RoundedWrites:
    """A cache layer whose `update_and_fetch` (the one call a model's attention makes to
    write its new keys and values) keeps them rounded; the rest is the layer's own."""

    def __init__(self, layer: Any, round: Callable[[mx.array], mx.array]) -> None:
        self._layer, self._round = layer, round

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self._layer.update_and_fetch(self._round(keys), self._round(values))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)


def _one_token_cache(model: nn.Module) -> list[Any]:
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    return cache


def kv_bytes_per_token(model: nn.Module) -> int:
    """What one more token adds to a request's cache, measured on a one-token forward.
    Sliding-window layers count as if they kept every token (an overestimate, on the safe
    side); recurrent state does not grow with tokens and counts nothing."""
    total = 0
    for layer in _one_token_cache(model):
        for array in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(array, mx.array):
                total += array[..., :1, :].nbytes
    return total


def kv_layout(model: nn.Module) -> tuple[mx.Dtype, tuple[int, int]]:
    """The dtype of a plain KV model's cache, and the head dimensions of its keys and
    values."""
    layer = _one_token_cache(model)[0]
    return layer.keys.dtype, (layer.keys.shape[-1], layer.values.shape[-1])
