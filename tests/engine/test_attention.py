"""The folded decode attention computes what MLX's own attention does, for every mask
mlx-lm's caches make, and the engine's models use it wherever MLX would fall back."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import base
from mlx_lm.models.cache import BatchKVCache

from engine import attention
from engine.loader import load_model


def _inputs(batch: int, heads: int, kv_heads: int, length: int, dim: int = 32):
    mx.random.seed(batch * 100 + heads + length)
    queries = mx.random.normal((batch, heads, 1, dim))
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


def test_what_is_not_a_masked_one_token_query_goes_to_mlx_lm() -> None:
    queries, keys, values = _inputs(1, 8, 2, 16)
    prompt = mx.random.normal((1, 8, 4, 32))
    for args in [(queries, None), (queries, "causal"), (prompt, "causal"),
                 (prompt, base.create_causal_mask(4, 12))]:
        ours = attention.scaled_dot_product_attention(args[0], keys, values, None, 0.5, args[1])
        theirs = base.scaled_dot_product_attention(args[0], keys, values, None, 0.5, args[1])
        assert mx.array_equal(ours, theirs).item()


def test_a_loaded_models_modules_use_it_off_metal(demo_model_dir) -> None:
    loaded = load_model(str(demo_model_dir))
    module = __import__(type(loaded.model).__module__, fromlist=["_"])
    expected = (base.scaled_dot_product_attention if mx.metal.is_available()
                else attention.scaled_dot_product_attention)
    assert module.scaled_dot_product_attention is expected
