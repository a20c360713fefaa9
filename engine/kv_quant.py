"""KV cache quantization (`--kv-bits`): what a quantized server's cached tokens hold.

The radix tree keeps each token's keys and values as mlx's affine quantization (packed
integers, a scale and a bias per group of `group_size` along the head dimension, as
mlx-lm's QuantizedKVCache groups them), 2-4x smaller than the model's dtype. The running
batch stays in the model's dtype: mlx-lm 0.32 has no quantized batch cache (its
BatchKVCache, whose rows of different lengths the generator merges, extends and filters,
is plain), so a request's own KV costs what it did.

A cache must never change an answer, so a request must attend over the same values
whether its prefix came from the tree or was computed by itself. So the state of a token
is its rounded KV: every write into a running cache is rounded (`round`), and the tree
stores `quantize` of the rounded values, which `dequantize` gives back bit for bit. Every
token attends over every other as kept, its own forward's included (mlx_lm_internals'
`rounded_writes`), so a prompt resumed from the tree computes what the cold prompt
computed, up to the float noise of forwards of other shapes (which rounding can turn into
a whole step where a value lies near a step's edge: docs/benchmarks.md). A rule where a
forward's own tokens attend over each other as computed kept the unquantized answer a
little more often (10 against 9 of 12 chats at 8 bits), but made what a token sees depend
on how its prompt was cut into forwards (chunks, hits, speculative steps).

The rounding must be a fixed point of the quantization, which one quantize-dequantize
round trip is not (requantizing its output picks other scales and moves values by a
whole step); two round trips computed in float32 are: a third changes nothing
(tests/engine/test_kv_quant.py checks it on random data; it held on every real model's
KV tried). Scales and biases are therefore float32: 8 bytes per group (0.125 bytes a
value at group size 64, where mlx-lm's are in the model's dtype, 0.0625 in bfloat16).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine.api import KV_BITS, KV_GROUP_SIZES

# Bytes of a group's scale and bias (float32 each).
SCALE_BIAS_BYTES = 8


@dataclass(frozen=True)
class KVQuantization:
    bits: int
    group_size: int
    dtype: mx.Dtype  # the model's KV dtype, what `dequantize` gives back

    def quantize(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Packed integers, scales and biases of `x` (lazily), grouped along its last axis."""
        return mx.quantize(x.astype(mx.float32), group_size=self.group_size, bits=self.bits)

    def dequantize(self, packed: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
        return mx.dequantize(packed, scales, biases, group_size=self.group_size,
                             bits=self.bits).astype(self.dtype)

    def round(self, x: mx.array) -> mx.array:
        """`x` as the tree gives it back: two round trips (see the module's docstring)."""
        return self.dequantize(*self.quantize(self.dequantize(*self.quantize(x))))

    def describe(self) -> str:
        return f"{self.bits}-bit, group size {self.group_size}"


def kv_quantization(bits: int | None, group_size: int, dtype: mx.Dtype,
                    head_dims: tuple[int, ...]) -> KVQuantization | None:
    """The quantization `--kv-bits`/`--kv-group-size` ask for (None: off), checked against
    the model's head dimensions (keys', values'), which whole groups must tile."""
    if bits is None:
        return None
    if bits not in KV_BITS or group_size not in KV_GROUP_SIZES:
        raise ValueError(f"kv_bits must be one of {KV_BITS} and kv_group_size one of "
                         f"{KV_GROUP_SIZES}, not {bits} and {group_size}")
    fits = [g for g in KV_GROUP_SIZES if all(dim % g == 0 for dim in head_dims)]
    if group_size not in fits:
        raise ValueError(f"kv_group_size {group_size} does not divide the model's head "
                         f"dimensions {head_dims}: choose one of {fits or 'none'}")
    return KVQuantization(bits, group_size, dtype)


def cached_bytes_per_token(kv_bytes_per_token: int, quantization: KVQuantization | None
                           ) -> int:
    """What a token of `kv_bytes_per_token` in the model's dtype takes in the tree."""
    if quantization is None:
        return kv_bytes_per_token
    values = kv_bytes_per_token // quantization.dtype.size
    return (values * quantization.bits // 8
            + values // quantization.group_size * SCALE_BIAS_BYTES)
