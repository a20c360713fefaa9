"""The folded attention computes what MLX's own attention does, for every mask mlx-lm's
caches make, and the engine's models use it wherever MLX would fall back: with MLX's
softmax, and on the CPU with engine.cpu_math's."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import activations, base
from mlx_lm.models.cache import BatchKVCache

from engine import attention, cpu_math, mlx_lm_internals
from engine.loader import load_model


def _inputs(batch: int, heads: int, kv_heads: int, length: int, dim: int = 32,
            queries_length: int = 1):
    mx.random.seed(batch * 100 + heads + length)
    queries = mx.random.normal((batch, heads, queries_length, dim))
    keys = mx.random.normal((batch, kv_heads, length, dim))
    values = mx.random.normal((batch, kv_heads, length, dim))
    return queries, keys, values


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4), (6, 1)])
def test_a_left_padded_batch_attends_as_mlx_attends(heads: int, kv_heads: int) -> None:
    queries, keys, values = _inputs(5, heads, kv_heads, 37)
    cache = BatchKVCache([0, 3, 11, 36, 20])
    mask = base.create_causal_mask(1, 36, left_padding=cache.left_padding)
    assert mask.dtype == mx.bool_
    ours = attention.folded_attention(queries, keys, values, 0.3, mask)
    theirs = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.3, mask=mask)
    assert ours.shape == theirs.shape
    assert mx.allclose(ours, theirs, atol=1e-5).item()


@pytest.mark.parametrize("shape", [(37,), (1, 37), (5, 1, 1, 37), (5, 8, 1, 37), (1, 1, 1, 37)])
def test_additive_masks_of_every_broadcast_shape_attend_as_mlx_attends(shape) -> None:
    queries, keys, values = _inputs(5, 8, 2, 37)
    mask = mx.random.normal(shape)
    ours = attention.folded_attention(queries, keys, values, 0.2, mask)
    theirs = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.2, mask=mask)
    assert mx.allclose(ours, theirs, atol=1e-5).item()


def test_a_bfloat16_batch_rounds_as_mlx_rounds() -> None:
    queries, keys, values = (x.astype(mx.bfloat16) for x in _inputs(4, 8, 2, 300))
    mask = base.create_causal_mask(1, 299, left_padding=mx.array([0, 5, 100, 299]))
    ours = attention.folded_attention(queries, keys, values, 32 ** -0.5, mask)
    theirs = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=32 ** -0.5,
                                                  mask=mask)
    assert ours.dtype == mx.bfloat16
    assert mx.array_equal(ours, theirs).item()


def _prompt_masks(batch: int, heads: int, length: int, total: int):
    """Every mask a prompt's attention gets: MLX's "causal", mlx-lm's causal arrays (after
    cached tokens, left-padded rows, a sliding window) and one additive row per head."""
    offset = total - length
    padding = mx.array([0, 3, offset][:batch])  # the last row's first query sees itself only
    return {
        "causal": "causal",
        "causal array": base.create_causal_mask(length, offset),
        "left-padded rows": base.create_causal_mask(length, offset, left_padding=padding),
        "sliding window": base.create_causal_mask(length, offset, window_size=5),
        "additive per head": mx.random.normal((batch, heads, length, total)),
    }


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4)])
@pytest.mark.parametrize("name", ["causal", "causal array", "left-padded rows",
                                  "sliding window", "additive per head"])
def test_a_prompt_attends_as_mlx_attends(heads: int, kv_heads: int, name: str) -> None:
    queries, keys, values = _inputs(3, heads, kv_heads, 29, queries_length=9)
    mask = _prompt_masks(3, heads, 9, 29)[name]
    theirs = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.3, mask=mask)
    folded = attention.folded_attention(queries, keys, values, 0.3, mask)
    assert mx.allclose(folded, theirs, atol=1e-5).item()
    on_cpu = attention.folded_attention(queries, keys, values, 0.3, mask, cpu_math.softmax)
    assert mx.allclose(on_cpu, theirs, atol=1e-5).item()


@pytest.mark.parametrize("name", ["causal", "causal array", "left-padded rows",
                                  "sliding window", "additive per head"])
def test_a_prompt_attends_as_mlx_attends_in_blocks_of_queries(monkeypatch, name: str) -> None:
    queries, keys, values = _inputs(3, 8, 2, 29, queries_length=9)
    mask = _prompt_masks(3, 8, 9, 29)[name]
    monkeypatch.setattr(attention, "BLOCK_BYTES", 4 * (3 * 8 * 29) * 2)  # 2 queries a block
    ours = attention.cpu_attention(queries, keys, values, 0.3, mask)
    theirs = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.3, mask=mask)
    assert mx.allclose(ours, theirs, atol=1e-5).item()


@pytest.mark.parametrize(("length", "total"), [(1, 1), (1, 40), (1, 3000), (64, 600)])
def test_on_the_cpu_every_query_attends_as_mlx_attends(length: int, total: int) -> None:
    queries, keys, values = _inputs(2, 8, 2, total, queries_length=length)
    for mask in (None, "causal", base.create_causal_mask(length, total - length)):
        with mx.stream(mx.cpu):
            ours = attention.scaled_dot_product_attention(queries, keys, values, None, 0.2,
                                                          mask)
            theirs = base.scaled_dot_product_attention(queries, keys, values, None, 0.2, mask)
        assert mx.allclose(ours, theirs, atol=1e-5).item()


def test_attention_sinks_and_quantized_caches_go_to_mlx_lm() -> None:
    queries, keys, values = _inputs(1, 8, 2, 16, queries_length=4)
    sinks = mx.zeros((8,))
    ours = attention.scaled_dot_product_attention(queries, keys, values, None, 0.5, "causal",
                                                  sinks)
    theirs = base.scaled_dot_product_attention(queries, keys, values, None, 0.5, "causal",
                                               sinks)
    assert mx.array_equal(ours, theirs).item()


def test_a_loaded_models_modules_use_it_and_the_engines_swiglu_off_metal(
        demo_model_dir) -> None:
    loaded = load_model(str(demo_model_dir))
    module = __import__(type(loaded.model).__module__, fromlist=["_"])
    on_metal = mx.metal.is_available()
    assert module.scaled_dot_product_attention is (
        base.scaled_dot_product_attention if on_metal else attention.scaled_dot_product_attention)
    assert module.swiglu is (activations.swiglu if on_metal else mlx_lm_internals.swiglu)
