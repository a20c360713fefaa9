"""engine.cpu_math computes what MLX's own exp, softmax and SiLU do, to float32's last
digits, on every value an attention score or an activation takes."""

import mlx.core as mx
import numpy as np
from mlx_lm.models import activations

from engine import cpu_math


def test_exp_is_mlx_exp_within_two_units_in_the_last_place() -> None:
    x = mx.concatenate([mx.linspace(-87, 88, 350_001), mx.random.normal((50_000,)) * 8])
    ours, theirs = np.array(cpu_math.exp(x)), np.array(mx.exp(x))
    assert (np.abs(ours - theirs) / theirs).max() < 2.5e-7
    assert (ours == theirs).mean() > 0.8  # MLX's polynomial, not another one


def test_exp_far_below_zero_is_zero_and_far_above_is_finite() -> None:
    assert cpu_math.exp(mx.array([-89.0, -1e30, -mx.inf])).tolist() == [0.0, 0.0, 0.0]
    huge = cpu_math.exp(mx.array([100.0, mx.inf])).tolist()
    assert all(1e38 < value < float("inf") for value in huge)  # a sigmoid then gives ~0


def test_softmax_matches_mlx_and_an_all_masked_row_is_zeros() -> None:
    scores = mx.random.normal((4, 12, 24, 300), key=mx.random.key(0)) * 6
    exact = mx.softmax(scores, axis=-1, precise=True)
    assert np.abs(np.array(cpu_math.softmax(scores)) - np.array(exact)).max() < 1e-6
    masked = mx.array([[-mx.inf, -mx.inf], [0.0, -mx.inf], [-200.0, 0.0]])
    assert cpu_math.softmax(masked).tolist() == [[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]
    lowest = mx.finfo(mx.float32).min  # how an attention mask fills its scores
    assert cpu_math.softmax(mx.array([[lowest, 3.0, lowest]])).tolist() == [[0.0, 1.0, 0.0]]


def test_softmax_of_half_precision_scores_is_computed_in_float32() -> None:
    scores = (mx.random.normal((8, 2000), key=mx.random.key(1)) * 4).astype(mx.bfloat16)
    ours = cpu_math.softmax(scores)
    assert ours.dtype == mx.bfloat16
    exact = mx.softmax(scores, axis=-1, precise=True)
    assert (ours != exact).sum().item() <= 0.01 * scores.size  # a rounding apart, rarely


def test_swiglu_is_mlx_lms() -> None:
    gate = mx.concatenate([mx.linspace(-120, 120, 20_001), mx.random.normal((20_000,)) * 4])
    x = mx.random.normal(gate.shape, key=mx.random.key(2))
    ours, theirs = np.array(cpu_math.swiglu(gate, x)), np.array(activations.swiglu(gate, x))
    assert np.allclose(ours, theirs, rtol=1e-6, atol=1e-30)
