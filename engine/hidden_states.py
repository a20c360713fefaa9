"""The last hidden states of a causal model's forward, beside its logits; and a forward
whose head runs only at the positions read.

An mlx-lm model returns logits only. Its body (`model.model` in mlx-lm's causal models:
embeddings, layers, final norm) returns the hidden states, and the head only projects
them, position by position; `HiddenStates` keeps the body's output of each forward, so
one forward gives both, read at the same positions (an embedding's last-token pooling,
readout.py). And since the head is a vocabulary-wide projection at every position (for
64 prompts of 18 new tokens and a 49k vocabulary, 57M logits where 64 rows are read),
`narrowed` hands it only the positions a forward's logits are read at.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
from mlx import nn

_TAPPED: dict[type, type] = {}


class HiddenStates:
    """The output of a causal model's body in its latest forward (None: not seen yet).

    The body's class is swapped for a subclass that records its output: the module, its
    parameters and their names stay as they are."""

    def __init__(self, model: nn.Module) -> None:
        self.last: mx.array | None = None
        # Within `narrowed`: the (rows, positions) the body's output reaches the head at.
        self.read_at: tuple[mx.array, mx.array] | None = None
        body = getattr(model, "model", None)
        self.available = isinstance(body, nn.Module)
        if self.available:
            if type(body) not in _TAPPED.values():  # a generator made anew keeps its tap
                body.__class__ = _tapped(type(body))
            body._hidden_states = self

    def take(self, rows: mx.array, positions: mx.array) -> mx.array:
        """The hidden state of each row at its position in the latest forward, which is
        let go of (a prompt's hidden states are large)."""
        hidden, self.last = self.last, None
        return hidden[rows, positions]

    @contextmanager
    def narrowed(self, rows: mx.array, positions: mx.array) -> Iterator[None]:
        """Within, a forward's logits are one position per row, (rows, 1, vocabulary):
        each row's at its position, the head computed there alone. The hidden states kept
        (`take`) are every position's as always. Only where `available`."""
        self.read_at = rows, positions
        try:
            yield
        finally:
            self.read_at = None


def _tapped(cls: type) -> type:
    if cls not in _TAPPED:
        def __call__(self: nn.Module, *args: object, **kwargs: object) -> mx.array:
            out = cls.__call__(self, *args, **kwargs)
            hidden_states = self._hidden_states
            hidden_states.last = out
            if hidden_states.read_at is None:
                return out
            rows, positions = hidden_states.read_at
            return out[rows, positions][:, None]

        _TAPPED[cls] = type(cls.__name__, (cls,), {"__call__": __call__})
    return _TAPPED[cls]
