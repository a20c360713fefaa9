"""Reads replayed from a trace (engine/compiled_read.py) read what the built forward reads:
the same tokens, logprobs and hidden states, for a shape's trace and every replay of it.

The engine takes them on a GPU only; here they are switched on for the CPU, where MLX
compiles a trace's fused kernels with the system's C++ compiler."""

from __future__ import annotations

import gc
import weakref

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from engine import compiled_read
from engine.compiled_read import CompiledReads
from engine.generator import Generator, Readings

PREAMBLE = list(range(40, 88))
SENTENCES = [list(range(200 + 7 * i, 200 + 7 * i + length))
             for i, length in enumerate([5, 9, 3, 9, 6])]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def model(family_model_dir):
    return load(family_model_dir("llama"))[0]


def preamble_span(model) -> tuple[list[mx.array], list[mx.array], int]:
    """The preamble's KV, as the tree hands a prefix over: per layer, keys and values."""
    cache = make_prompt_cache(model)
    model(mx.array([PREAMBLE]), cache=cache)
    n = len(PREAMBLE)
    keys = [layer.keys[..., :n, :] for layer in cache]
    values = [layer.values[..., :n, :] for layer in cache]
    mx.eval(keys, values)
    return keys, values, n


def read(generator: Generator, span, sentences: list[list[int]], hidden: bool = False
         ) -> Readings:
    return generator.read_together([[span]] * len(sentences), sentences, top=3,
                                   asked=[5, 17], hidden=hidden)


def assert_same(got: Readings, want: Readings) -> None:
    assert got.tokens == want.tokens
    assert got.top_ids == want.top_ids
    for name in ("logprobs", "top_logprobs", "asked", "hidden"):
        assert np.allclose(getattr(got, name), getattr(want, name), atol=TOLERANCE), name


@pytest.mark.parametrize("hidden", [False, True])
def test_a_shape_seen_again_is_traced_then_replayed_and_reads_the_same(model, hidden):
    span = preamble_span(model)
    built = Generator(model)
    assert built.compiled_reads is None  # the CPU's engine builds every read
    want = read(built, span, SENTENCES, hidden)
    compiled = Generator(model)  # the model's hidden states are the latest generator's
    compiled.compiled_reads = CompiledReads(model, compiled.hidden)
    for _ in range(3):  # built (first seen), traced, replayed
        assert_same(read(compiled, span, SENTENCES, hidden), want)
    assert compiled.compiled_reads.traced(len(SENTENCES), 9, len(PREAMBLE), hidden)
    assert compiled.hidden.last is None  # nor is the trace's body output kept


def test_rows_over_prefixes_of_other_lengths_are_built(model):
    """A row over a shorter prefix is left-padded: masked by an array, not "causal", so
    that read is built whatever its shape."""
    generator = Generator(model)
    generator.compiled_reads = CompiledReads(model, generator.hidden)
    keys, values, n = preamble_span(model)
    short = ([k[..., :n - 8, :] for k in keys], [v[..., :n - 8, :] for v in values], n - 8)
    prefixes = [[(keys, values, n)], [short]]
    feeds = SENTENCES[:2]
    for _ in range(3):
        readings = generator.read_together(prefixes, feeds, top=0, asked=[], hidden=False)
    alone = Generator(model).read_together([[short]], feeds[1:], top=0, asked=[],
                                           hidden=False)
    assert readings.tokens[1] == alone.tokens[0]
    assert abs(readings.logprobs[1] - alone.logprobs[0]) < TOLERANCE
    assert not any(generator.compiled_reads.traced(2, 9, length, False) for length in (n, n - 8))


def test_shapes_are_traced_the_second_time_and_let_go_of_together(model, monkeypatch):
    monkeypatch.setattr(compiled_read, "MAX_TRACES", 2)
    reads = CompiledReads(model, Generator(model).hidden)
    assert [reads.traced(64, 17, 48, False) for _ in range(3)] == [False, True, True]
    assert reads.traced(64, 17, 48, True) is False  # hidden states wanted: another trace
    assert reads.traced(64, 17, 48, True) is True
    functions = reads._functions
    assert [reads.traced(128, 17, 48, False) for _ in range(2)] == [False, True]
    assert reads._functions is not functions  # the third trace let the first two go
    assert reads.traced(64, 17, 48, False) is True  # seen before: traced anew


def test_a_generator_let_go_of_takes_its_traces_and_model_with_it(family_model_dir):
    """A traced read's function holds the model (its weights are the trace's constants):
    an unloaded model's memory must not stay behind in it."""
    model = load(family_model_dir("llama"))[0]
    generator = Generator(model)
    generator.compiled_reads = CompiledReads(model, generator.hidden)
    span = preamble_span(model)
    for _ in range(2):
        read(generator, span, SENTENCES)
    gone = weakref.ref(model)
    del model, generator, span
    gc.collect()
    assert gone() is None
