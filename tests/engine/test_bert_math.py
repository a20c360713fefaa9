"""The encoder's GELU and softmax, written in multiplies and adds for MLX's CPU backend
(engine/bert.py), against MLX's own `erf` and `exp`."""

import mlx.core as mx
import numpy as np
from mlx import nn

from engine.bert import BertConfig, SelfAttention, exp_nonpositive, gelu, softmax


def test_gelu_is_the_erf_gelu() -> None:
    x = mx.concatenate([mx.linspace(-12, 12, 240_001), mx.random.normal((50_000,)) * 3])
    assert np.abs(np.array(gelu(x)) - np.array(nn.gelu(x))).max() < 2e-6
    assert gelu(mx.array([-20.0, 0.0, 20.0])).tolist() == [0.0, 0.0, 20.0]


def test_exp_of_a_nonpositive_number_within_3e_5_relative() -> None:
    x = mx.linspace(-86, 0, 200_001)
    exact = np.exp(np.array(x, np.float64))
    assert (np.abs(np.array(exp_nonpositive(x)) - exact) / exact).max() < 3e-5
    # Below float32's smallest normal: zero, not a denormal or garbage.
    assert exp_nonpositive(mx.array([-90.0, -1e30, -mx.inf])).tolist() == [0.0, 0.0, 0.0]


def test_softmax_matches_mlx_and_an_all_masked_row_is_zeros() -> None:
    scores = mx.random.normal((4, 12, 24, 24), key=mx.random.key(0)) * 6
    exact = mx.softmax(scores, axis=-1, precise=True)
    assert np.abs(np.array(softmax(scores)) - np.array(exact)).max() < 5e-6
    masked = mx.array([[-mx.inf, -mx.inf], [0.0, -mx.inf], [-200.0, 0.0]])
    assert softmax(masked).tolist() == [[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]


def test_cpu_attention_equals_the_fused_attention_a_gpu_runs() -> None:
    config = BertConfig(vocab_size=10, hidden_size=64, num_hidden_layers=1,
                        num_attention_heads=4, intermediate_size=128,
                        max_position_embeddings=16)
    attention = SelfAttention(config)
    x = mx.random.normal((3, 7, 64), key=mx.random.key(1))
    real = mx.array([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5])
    mask = mx.where(real[:, None, None, :] > 0, 0.0, -mx.inf)

    def heads(projection):
        return projection(x).reshape(3, 7, 4, 16).transpose(0, 2, 1, 3)

    fused = mx.fast.scaled_dot_product_attention(
        heads(attention.query), heads(attention.key), heads(attention.value), scale=0.25,
        mask=mask).transpose(0, 2, 1, 3).reshape(3, 7, 64)
    assert np.abs(np.array(attention(x, mask)) - np.array(fused)).max() < 1e-5
