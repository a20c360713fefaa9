"""The encoder's GELU, written in multiplies and adds for MLX's CPU backend
(engine/bert.py), against MLX's own `erf`, and its attention on the CPU against the fused
one."""

import mlx.core as mx
import numpy as np
from mlx import nn

from engine.bert import BertConfig, SelfAttention, gelu


def test_gelu_is_the_erf_gelu() -> None:
    x = mx.concatenate([mx.linspace(-12, 12, 240_001), mx.random.normal((50_000,)) * 3])
    assert np.abs(np.array(gelu(x)) - np.array(nn.gelu(x))).max() < 2e-6
    assert gelu(mx.array([-20.0, 0.0, 20.0])).tolist() == [0.0, 0.0, 20.0]


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
