"""A prompts-read-together forward (`Generator.read_together`) replayed from a trace.

A classify list's read is one forward of its rows over their cached preamble, and MLX
builds that forward's graph in Python every time. On an H200 (Llama-1B shape, 64 rows of
17 tokens over a 48-token preamble) the read took 8.9 ms built and run, 7.0 replayed
from `mx.compile`'s trace: most of the difference is the graph's Python, the rest
elementwise ops fused into fewer kernels
(bench/results/nvidia-h200/compiled-read-forward-1b-vocab49152). In the engine, lists of
64 read one at a time went 7% faster (bench/results/nvidia-h200/compiled-read-1b-vocab49152).

A trace holds for one set of input shapes (rows, width, prefix length), and tracing costs
a forward's Python and, the first time, the fused kernels' compilation. So a shape is
traced the second time it comes, which a server reading lists of one preamble does over
and over, and the traces are let go of together once there are MAX_TRACES of them.

Only reads whose rows' prefixes are of one length take it (no row left-padded: MLX's
"causal" mask, as `causal_rows`), on models whose every layer is a plain KV cache and whose
body the head can be narrowed behind (`HiddenStates`); a quantized server's KV rounding
and Qwen-VL's M-RoPE placement stay on the built path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm.models.cache import KVCache

from engine.hidden_states import HiddenStates

# Traces kept before all are let go of: a classify workload's reads come in a few row
# counts (lists of one size, a step reading one to four of them) times a few widths.
MAX_TRACES = 64
# Shapes remembered as seen once, before that memory is let go of.
MAX_SEEN = 4096

Shape = tuple[int, int, int, bool]  # rows, width, prefix length, hidden states wanted


class CompiledReads:
    """Read forwards of shapes seen before, from their traces."""

    def __init__(self, model: nn.Module, hidden: HiddenStates) -> None:
        self._model = model
        self._hidden = hidden
        self._seen: set[Shape] = set()
        self._traced: set[Shape] = set()
        self._functions = self._compiled()

    def traced(self, rows: int, width: int, prefix: int, hidden: bool) -> bool:
        """Whether a read of `rows` rows of `width` tokens after `prefix` cached ones runs
        from a trace (`read`): a shape seen before. The first time, it is noted, for the
        caller to build that read."""
        shape: Shape = (rows, width, prefix, hidden)
        if shape in self._traced:
            return True
        if shape not in self._seen:
            if len(self._seen) >= MAX_SEEN:
                self._seen.clear()
            self._seen.add(shape)
            return False
        if len(self._traced) >= MAX_TRACES:
            self._functions = self._compiled()  # the old functions' traces go with them
            self._traced.clear()
        self._traced.add(shape)
        return True

    def read(self, inputs: mx.array, keys: Sequence[mx.array], values: Sequence[mx.array],
             ends: mx.array, hidden: bool) -> tuple[mx.array, mx.array | None]:
        """Each row's logprobs at its last position `ends[row]` of `inputs` (right-padded
        rows after prefixes of one length, whose KV each layer's `keys` and `values` hold
        with room for `inputs` after it), and its hidden state there if `hidden`."""
        logprobs, states = self._functions[hidden](inputs, list(keys), list(values), ends)
        return logprobs, states if hidden else None

    def _compiled(self) -> dict[bool, Callable[..., Any]]:
        return {wanted: mx.compile(self._reader(wanted)) for wanted in (False, True)}

    def _reader(self, hidden: bool) -> Callable[..., tuple[mx.array, mx.array]]:
        def read(inputs: mx.array, keys: list[mx.array], values: list[mx.array],
                 ends: mx.array) -> tuple[mx.array, mx.array]:
            cache = []
            for layer_keys, layer_values in zip(keys, values):
                layer = KVCache()
                layer.keys, layer.values = layer_keys, layer_values
                layer.offset = layer_keys.shape[2] - inputs.shape[1]
                cache.append(layer)
            rows = mx.arange(inputs.shape[0])
            with self._hidden.narrowed(rows, ends):
                logits = self._model(inputs, cache=cache)[:, 0]
            # Taken either way: the tap keeps the traced body's output otherwise.
            states = self._hidden.take(rows, ends)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return logprobs, (states.astype(mx.float32) if hidden else mx.zeros(0))
        return read
