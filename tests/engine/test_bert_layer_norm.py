"""The encoder's layer norm on the CPU (engine/bert.py: means as matrix-vector products)
against the exact one, in float64."""

import mlx.core as mx
import numpy as np
import pytest

from engine.bert import LayerNorm


@pytest.mark.parametrize("offset", [0, 300])
def test_cpu_layer_norm_is_the_exact_layer_norm_even_far_from_zero(offset: int) -> None:
    norm = LayerNorm(384, eps=1e-12)
    norm.weight = mx.random.normal((384,), key=mx.random.key(0))
    norm.bias = mx.random.normal((384,), key=mx.random.key(1))
    # offset 300: a mean far above the spread, which a one-pass variance loses (MLX's
    # own layer norm is 5e-4 off there).
    x = mx.random.normal((3, 26, 384), key=mx.random.key(2)) * 2 + offset
    rows = np.array(x, np.float64)
    exact = ((rows - rows.mean(-1, keepdims=True))
             / np.sqrt(rows.var(-1, keepdims=True) + 1e-12) * np.array(norm.weight)
             + np.array(norm.bias))
    assert np.abs(np.array(norm(x)) - exact).max() < (1e-5 if offset == 0 else 2e-4)


def test_cpu_layer_norm_has_only_the_parameters_hugging_face_names() -> None:
    assert sorted(LayerNorm(8, eps=1e-5).parameters()) == ["bias", "weight"]
