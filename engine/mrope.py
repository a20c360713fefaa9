"""Qwen-VL's M-RoPE positions on mlx-lm's language model, so that an image prompt's forward
is mlx-vlm's while the engine keeps its own batched caches.

mlx-lm loads Qwen2-VL's and Qwen2.5-VL's language model as a plain Qwen2: each layer
rotates queries and keys with 1-D RoPE at its cache's offset (per row in a batch cache).
mlx-vlm gives a prompt's tokens 3-D (t, h, w) positions (`get_rope_index`): a text token's
three are equal, an image's tokens take their grid's, and the text after an image goes on
from the image's largest position + 1. So a prompt's positions are a function of its tokens
and its images' grids alone (a cached prefix holds the KV a cold run computes), and past
its last image every token sits at its index + the prompt's `rope_delta` (negative: an
image takes fewer positions than tokens). M-RoPE at (p, p, p) is 1-D RoPE at p: each
frequency reads one of three equal positions (mlx-vlm's `compute_mrope_frequencies` says
as much of its 2-D positions). Hence:

- a prefill chunk of a prompt with images is rotated at its 3-D positions by mlx-vlm's
  own rotary embedding (`apply_rotary`, as its attention does);
- a decode or verify step rotates each row at its cache offset + that row's delta, one
  shift per row (0 for a row without images); MLX's RoPE takes per-row offsets, so a
  verify's several positions per row follow from the shifted offset as they do unshifted.

`MRoPE` swaps each layer's RoPE for a `PlacedRoPE` that reads the `Placement` set around
the forward (`MRoPE.placed`); with none set it is the layer's own RoPE, so text-only
forwards run exactly as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
from mlx import nn


@dataclass(frozen=True)
class Placement:
    """Where one forward's tokens are: `grid` (3, B, L), the M-RoPE positions of each fed
    token; or `shifts` (B,), what each row's positions are past its cache offset."""

    grid: mx.array | None = None
    shifts: mx.array | None = None


@dataclass(frozen=True)
class PromptPositions:
    """A prompt's M-RoPE positions, (3, L), and how far past its index each token after
    its last image is (`rope_delta`), decode included."""

    grid: mx.array
    rope_delta: int

    def chunk(self, start: int, end: int) -> Placement:
        return Placement(grid=self.grid[:, None, start:end])


class _Forward:
    """The placement of the forward being built, shared by every layer."""

    def __init__(self, rotary: nn.Module) -> None:
        self.rotary = rotary  # mlx-vlm's rotary embedding of the same model
        self.placement: Placement | None = None


class PlacedRoPE(nn.Module):
    """A layer's RoPE, at the positions the forward's `Placement` says."""

    def __init__(self, rope: nn.Module, forward: _Forward) -> None:
        super().__init__()
        self.rope = rope
        self._forward = forward

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        placement = self._forward.placement
        if placement is None:
            return self.rope(x, offset=offset)
        if placement.shifts is not None:
            return self.rope(x, offset=offset + placement.shifts)
        # mlx-vlm rotates queries and keys together, a layer here one at a time: the
        # second output is dropped (unless a fused kernel makes both, never computed).
        return self._forward.rotary.apply_rotary(x, x, placement.grid)[0]


class MRoPE:
    """The M-RoPE positions of an mlx-lm Qwen-VL language model's forwards."""

    def __init__(self, model: nn.Module, rotary: nn.Module) -> None:
        """Swap the RoPE of `model`'s layers; `rotary`: mlx-vlm's rotary embedding of the
        same model, which rotates at 3-D positions."""
        self._forward = _Forward(rotary)
        for layer in model.layers:
            layer.self_attn.rope = PlacedRoPE(layer.self_attn.rope, self._forward)

    @contextmanager
    def placed(self, placement: Placement | None) -> Iterator[None]:
        """Build the forwards inside at `placement` (None: at the caches' offsets)."""
        self._forward.placement = placement
        try:
            yield
        finally:
            self._forward.placement = None
