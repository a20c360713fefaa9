"""Sampling a batch's rows together: each row's token, bias and penalties are what the
row gives alone, and what mlx-lm's processors and OpenAI's penalties define."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from engine.api import SamplingParams
from engine.sampling import Penalties, Sampler, draw, make_penalties, penalize


def test_a_batch_draws_each_row_as_its_sampler_alone_would():
    """`draw` filters, tempers and draws a batch's rows together: each row's token is the
    one its sampler draws from that row alone, whatever filters and seeds its neighbours
    have, in the model's dtype or float32."""
    vocabulary = 512
    options = [{"temperature": 1.0, "seed": 1}, {"temperature": 0.7, "top_p": 0.9, "seed": 2},
               {"temperature": 1.3, "top_k": 5, "seed": 3},
               {"temperature": 0.7, "top_p": 0.9, "seed": 4},
               {"temperature": 0.9, "min_p": 0.2, "seed": 5}, {"temperature": 1.0, "seed": 6}]
    for dtype in (mx.bfloat16, mx.float32):
        logits = (mx.random.normal((len(options), vocabulary), key=mx.random.key(3)) * 3)
        logprobs = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).astype(dtype)
        samplers = [Sampler(SamplingParams(max_tokens=8, **o), vocabulary) for o in options]
        alone = [Sampler(SamplingParams(max_tokens=8, **o), vocabulary) for o in options]
        for _ in range(8):
            together = draw(samplers, logprobs).tolist()
            assert together == [draw([s], logprobs[i:i + 1]).item() for i, s in enumerate(alone)]
        assert all(s.position == 8 for s in samplers + alone)


def test_penalties_are_mlx_lms_processors_and_openais_penalties_on_every_row_at_once():
    """`penalize` biases and repetition-penalizes as mlx-lm's logits processors do (the
    last 20 tokens, the prompt's included), and subtracts OpenAI's presence and frequency
    penalties over the generated tokens alone, for each row of a batch from its own
    context."""
    vocabulary, prompt = 64, [3, 5, 5, 7, 9, 11, 3, 13]
    asks = [{"logit_bias": {5: 2.0, 40: -1.5}}, {"repetition_penalty": 1.7},
            {"presence_penalty": 0.6, "frequency_penalty": 0.9},
            {"logit_bias": {7: 1.0}, "repetition_penalty": 1.2, "frequency_penalty": 0.4}]
    generated = [[20, 21, 20, 5], [5, 30, 30, 30, 2], [7, 7, 40, 7, 41], [9, 3, 9]]
    logits = mx.random.normal((len(asks), vocabulary), key=mx.random.key(7)) * 4
    rows = []
    for i, (ask, output) in enumerate(zip(asks, generated)):
        penalties = Penalties(SamplingParams(max_tokens=8, **ask), len(prompt))
        rows.append((i, penalties, *penalties.seen(prompt + output[:-1], output[-1]), []))
    found = penalize(logits, rows)
    for i, (ask, output) in enumerate(zip(asks, generated)):
        expected = logits[i:i + 1]
        context = mx.array(prompt + output)
        for process in make_logits_processors(logit_bias=ask.get("logit_bias"),
                                              repetition_penalty=ask.get("repetition_penalty")):
            expected = process(context, expected)
        counts = mx.zeros((vocabulary,)).at[mx.array(output)].add(1)
        expected = expected - (ask.get("frequency_penalty", 0.0) * counts
                               + ask.get("presence_penalty", 0.0) * (counts > 0))
        assert mx.allclose(found[i], expected[0], atol=1e-5), i


def test_stop_tokens_are_barred_from_the_first_min_tokens_draws_alone():
    """With `min_tokens` 3 a row's stop tokens are barred from its draws until it has
    generated 3 tokens (vLLM's rule), at the lowest finite logit in the model's dtype:
    below every other token, yet still the draw of a grammar that allows nothing else."""
    prompt, stops = [3, 5, 7], frozenset({2, 9})
    penalties = Penalties(SamplingParams(max_tokens=8, min_tokens=3), len(prompt), stops)
    assert penalties.barred(prompt, None) == [2, 9]  # the first draw
    assert penalties.barred(prompt + [4], 6) == [2, 9]  # the third
    assert penalties.barred(prompt + [4, 6], 8) == []  # the fourth
    assert make_penalties(SamplingParams(max_tokens=8, min_tokens=3), 3, frozenset()) is None
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        logits = mx.zeros((2, 12), dtype)
        found = penalize(logits, [(1, penalties, [], {}, [2, 9])])
        lowest = mx.finfo(dtype).min
        assert found[1, 2].item() == found[1, 9].item() == lowest
        assert mx.isfinite(found).all().item() and (found[0] == 0).all().item()


def test_a_repetition_penalty_looks_at_as_many_tokens_as_its_context_says():
    """`repetition_context`: the last that many tokens of the context (20 unless said, as
    mlx-lm's); -1 the whole context and 0 none, as Ollama's repeat_last_n."""
    context = list(range(100))

    def seen(**ask) -> list[int]:
        params = SamplingParams(max_tokens=8, repetition_penalty=1.3, **ask)
        penalties = make_penalties(params, len(context))
        return penalties.seen(context, 100)[0] if penalties.repetition else []

    assert seen() == list(range(81, 101))
    assert seen(repetition_context=64) == list(range(37, 101))
    assert seen(repetition_context=-1) == list(range(101))
    assert seen(repetition_context=0) == []
