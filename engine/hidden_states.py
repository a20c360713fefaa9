"""The last hidden states of a causal model's forward, beside its logits.

An mlx-lm model returns logits only. Its body (`model.model` in mlx-lm's causal models:
embeddings, layers, final norm) returns the hidden states, and the head only projects
them; `HiddenStates` keeps the body's output of each forward, so one forward gives both,
read at the same positions (an embedding's last-token pooling, readout.py).
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn

_TAPPED: dict[type, type] = {}


class HiddenStates:
    """The output of a causal model's body in its latest forward (None: not seen yet).

    The body's class is swapped for a subclass that records its output: the module, its
    parameters and their names stay as they are."""

    def __init__(self, model: nn.Module) -> None:
        self.last: mx.array | None = None
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


def _tapped(cls: type) -> type:
    if cls not in _TAPPED:
        def __call__(self: nn.Module, *args: object, **kwargs: object) -> mx.array:
            out = cls.__call__(self, *args, **kwargs)
            self._hidden_states.last = out
            return out

        _TAPPED[cls] = type(cls.__name__, (cls,), {"__call__": __call__})
    return _TAPPED[cls]
