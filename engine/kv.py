"""The MLX data a radix node owns, and how a request's cache is rebuilt from it.

Two kinds of handle, because mlx-lm models keep two kinds of state:

- `KVSegment`: per layer, the keys and values of one node's token span. Used when every
  layer is a plain `KVCache`; any prefix of a cached sequence can then be reused, so
  segments split at any token.
- `CacheSnapshot`: the whole per-layer cache state after the node's last token. Used for
  sliding-window (rotating), recurrent (arrays) and other caches whose state at an earlier
  position cannot be recovered from a later one, so snapshots never split.

Both hold owned, evaluated copies: a slice would keep the whole batch buffer alive.

`KVStore` is the one place handles are made (`handle`), freed (`free`, the tree's
callback) and assembled into a request's cache (`assemble`). Handles are made lazily and
evaluated together (`settle`): each evaluation is a round trip to the device, and a step
that ends 64 short requests makes 64 handles or more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from engine.kv_quant import KVQuantization
from engine.mlx_lm_internals import (
    BatchRow,
    cache_arrays,
    clone_cache,
    kv_span,
    owned,
    presized_kv,
    supports_segments,
)
from radix import Node

# Per layer keys (or values) of a span, each [1, heads, tokens, dim]: a list of them, or
# one array stacked over layers ([layers, 1, heads, tokens, dim], copied out of a batch
# in one operation). Either way `keys[layer]` is a layer's.
LayerArrays = Sequence[mx.array] | mx.array
# A quantized segment's keys (or values): packed integers, scales and biases, each
# `LayerArrays` with the tokens on the same axis.
Triple = tuple[LayerArrays, LayerArrays, LayerArrays]


class KVSegment:
    """Keys and values of one token span, per layer (`LayerArrays`). On a quantized server
    (kv_quant.py) it keeps each as mlx's (packed, scales, biases) triple of `LayerArrays`,
    and `keys`/`values` dequantize them, lazily, at each use."""

    splittable = True

    def __init__(self, keys: LayerArrays | Triple, values: LayerArrays | Triple,
                 defer: Callable[[KVSegment], None] | None = None,
                 quantization: KVQuantization | None = None) -> None:
        self.stored = (keys, values)  # as given: arrays, or their triples if quantized
        self.quantization = quantization
        self.nbytes = sum(_nbytes(arrays) for arrays in self.arrays)
        # Tokens (read once: a stacked array's is a slice); packed arrays have as many.
        self.length = self.arrays[0][0].shape[-2]
        # Hands the copies a split makes to whoever evaluates them with other new handles
        # (its KVStore, at `settle`); None: the split evaluates them itself.
        self.defer = defer

    @classmethod
    def of(cls, keys: LayerArrays, values: LayerArrays,
           quantization: KVQuantization | None = None) -> KVSegment:
        """A segment of these keys and values, quantized (lazily) if `quantization`."""
        if quantization is None:
            return cls(keys, values)
        return cls(_quantize(keys, quantization), _quantize(values, quantization),
                   quantization=quantization)

    @classmethod
    def from_cache(cls, cache: Sequence[KVCache], start: int, end: int,
                   quantization: KVQuantization | None = None) -> KVSegment:
        """Copy tokens [start, end) out of a single-sequence cache (lazily: see `arrays`)."""
        keys, values = zip(*(kv_span(layer, start, end) for layer in cache))
        return cls.of(list(keys), list(values), quantization)

    @classmethod
    def from_batch_row(cls, row: BatchRow, start: int, end: int,
                       quantization: KVQuantization | None = None) -> KVSegment:
        """Copy tokens [start, end) of a batch row, all layers at once (lazily)."""
        return cls.of(*row.span(start, end), quantization)

    @property
    def keys(self) -> LayerArrays:
        return self._plain(self.stored[0])

    @property
    def values(self) -> LayerArrays:
        return self._plain(self.stored[1])

    def _plain(self, stored: LayerArrays | Triple) -> LayerArrays:
        if self.quantization is None:
            return stored
        if isinstance(stored[0], mx.array):
            return self.quantization.dequantize(*stored)
        return [self.quantization.dequantize(*layer) for layer in zip(*stored)]

    @property
    def arrays(self) -> list[LayerArrays]:
        """What to evaluate to materialize the copy: keys and values, or their triples."""
        if self.quantization is None:
            return list(self.stored)
        return [*self.stored[0], *self.stored[1]]

    def split(self, at: int) -> tuple[KVSegment, KVSegment]:
        head, tail = (KVSegment(*(self._cut(stored, start, end) for stored in self.stored),
                                self.defer, self.quantization)
                      for start, end in ((0, at), (at, None)))
        if self.defer is None:
            mx.eval(head.arrays, tail.arrays)
        else:
            self.defer(head)
            self.defer(tail)
        return head, tail

    def _cut(self, stored: LayerArrays | Triple, start: int, end: int | None
             ) -> LayerArrays | Triple:
        if self.quantization is None:
            return _cut(stored, start, end)
        return tuple(_cut(arrays, start, end) for arrays in stored)


def _quantize(arrays: LayerArrays, quantization: KVQuantization) -> Triple:
    if isinstance(arrays, mx.array):
        return quantization.quantize(arrays)
    packed, scales, biases = zip(*(quantization.quantize(a) for a in arrays))
    return list(packed), list(scales), list(biases)


def _nbytes(arrays: LayerArrays) -> int:
    return arrays.nbytes if isinstance(arrays, mx.array) else sum(a.nbytes for a in arrays)


def _cut(arrays: LayerArrays, start: int, end: int | None) -> LayerArrays:
    """Owned copies of tokens [start, end) of every layer's array, stacked or not."""
    if isinstance(arrays, mx.array):
        return owned(arrays[..., start:end, :])
    return [owned(a[..., start:end, :]) for a in arrays]


class CacheSnapshot:
    """The full per-layer cache state after a node's last token."""

    splittable = False

    def __init__(self, cache: list[Any]) -> None:
        self.cache = cache
        self.nbytes = sum(c.nbytes for c in cache)

    @classmethod
    def from_cache(cls, cache: Sequence[Any]) -> CacheSnapshot:
        """Copy a single-sequence cache's state (lazily: see `arrays`)."""
        return cls(clone_cache(cache))

    @property
    def arrays(self) -> list[Any]:
        return cache_arrays(self.cache)

    def split(self, at: int) -> tuple[CacheSnapshot, CacheSnapshot]:
        raise TypeError("a whole-state snapshot cannot be split")


def assemble(handles: Sequence[KVSegment | CacheSnapshot], model: nn.Module) -> list[Any]:
    """A fresh cache of `model` holding the state of a matched path (empty for an empty
    path).

    Segments are copied per layer into one buffer with room to grow; a snapshot path
    reuses the deepest snapshot only (it already contains everything before it).
    """
    if not handles:
        return make_prompt_cache(model)
    last = handles[-1]
    if isinstance(last, CacheSnapshot):
        return clone_cache(last.cache)
    spans = [(h.keys, h.values) for h in handles]  # read once: a quantized one dequantizes
    return [presized_kv([keys[layer] for keys, _ in spans],
                        [values[layer] for _, values in spans])
            for layer in range(len(spans[0][0]))]


class KVStore:
    """Where the scheduler's KV handles come from and go to, for one model."""

    def __init__(self, model: nn.Module, quantization: KVQuantization | None = None) -> None:
        self.model = model
        self.segments = supports_segments(make_prompt_cache(model))
        self.quantization = quantization  # of the segments it makes
        self._unsettled: list[KVSegment | CacheSnapshot] = []
        self._waiting: list[tuple[list[mx.array], Callable[[], None]]] = []

    def handle(self, cache: list[Any] | BatchRow, start: int, end: int
               ) -> KVSegment | CacheSnapshot:
        """The handle of tokens [start, end) of a single-sequence cache, or of a batch's
        row (a snapshot covers everything the cache holds, which must then end at `end`).
        Its copy is computed at the next `settle`, which must come before `cache` is
        written to again (or the write copies the buffer the copy still reads)."""
        if isinstance(cache, BatchRow):
            handle = KVSegment.from_batch_row(cache, start, end, self.quantization)
        elif self.segments:
            handle = KVSegment.from_cache(cache, start, end, self.quantization)
        else:
            handle = CacheSnapshot.from_cache(cache)
        if isinstance(handle, KVSegment):
            handle.defer = self._defer  # and what splitting it copies
        self._unsettled.append(handle)
        return handle

    def _defer(self, handle: KVSegment) -> None:
        self._unsettled.append(handle)

    def after_settle(self, arrays: list[mx.array], then: Callable[[], None]) -> None:
        """Evaluate `arrays` (derived from handles: the disk tier's copies of them) with
        the next `settle`'s handles, then call `then`. Engine thread only."""
        self._waiting.append((arrays, then))

    def settle(self) -> None:
        """Compute every handle made (or split) since the last call, and whatever waits
        on them (`after_settle`), in one evaluation."""
        if self._unsettled or self._waiting:
            handles, self._unsettled = self._unsettled, []
            waiting, self._waiting = self._waiting, []
            mx.eval([handle.arrays for handle in handles], [arrays for arrays, _ in waiting])
            for _, then in waiting:
                then()

    def free(self, handle: KVSegment | CacheSnapshot) -> None:
        """The tree dropped `handle`; its arrays go when the last reference does."""

    def segments_of(self, node: Node) -> list[KVSegment] | None:
        """The segments of the path from the root down to `node` (None for a model whose
        handles are snapshots): requests on one path get the same segment objects, which
        the generator copies once for all of them when it prefills them together."""
        return path_handles(node) if self.segments else None

    def assemble(self, node: Node) -> list[Any]:
        """A fresh cache holding the state of the path from the root down to `node`."""
        return assemble(path_handles(node), self.model)


def path_handles(node: Node) -> list[Any]:
    """The handles from the root down to `node` (junctions without state skipped)."""
    handles = []
    while node.parent is not None:
        if node.handle is not None:
            handles.append(node.handle)
        node = node.parent
    return handles[::-1]
