"""Per-request samplers, logits processors and logprobs, built on mlx-lm's.

Greedy requests get no sampler of their own (None), so a batch of greedy requests is
sampled with one batched argmax instead of one call per row.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from engine.api import SamplingParams, TokenLogprob
from engine.generator import Scores
from engine.tokenizer import ModelTokenizer

# (the tokens so far, prompt included; logits) -> logits
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


class Sampler:
    """A request's sampling: its filters and temperature over the log-distribution, and
    its own random key, so a seeded request is reproducible whatever else runs in the
    same batch."""

    def __init__(self, params: SamplingParams, vocab_size: int) -> None:
        self._filters: list[Callable[[mx.array], mx.array]] = []
        if 0.0 < params.top_p < 1.0:
            self._filters.append(lambda x: apply_top_p(x, params.top_p))
        if params.min_p > 0.0:
            self._filters.append(lambda x: apply_min_p(x, params.min_p))
        if 0 < params.top_k < vocab_size:
            self._filters.append(lambda x: apply_top_k(x, params.top_k))
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._key = mx.random.key(seed)
        self._inverse_temperature = 1.0 / params.temperature

    def next_key(self) -> mx.array:
        self._key, step_key = mx.random.split(self._key)
        return step_key

    def logits(self, logprobs: mx.array) -> mx.array:
        """The unnormalized log-distribution tokens are drawn from."""
        for apply in self._filters:
            logprobs = apply(logprobs)
        return logprobs * self._inverse_temperature

    def __call__(self, logprobs: mx.array) -> mx.array:
        return mx.random.categorical(self.logits(logprobs), key=self.next_key())


def make_sampler(params: SamplingParams, vocab_size: int) -> Sampler | None:
    """The request's sampler; None for greedy."""
    return None if params.greedy else Sampler(params, vocab_size)


def make_processors(params: SamplingParams, prompt_length: int) -> list[LogitsProcessor]:
    """logit_bias and repetition_penalty as mlx-lm applies them; presence and frequency
    penalties as OpenAI defines them (see `openai_penalties`)."""
    processors = make_logits_processors(
        logit_bias=params.logit_bias or None, repetition_penalty=params.repetition_penalty)
    if params.presence_penalty or params.frequency_penalty:
        processors.append(openai_penalties(params.presence_penalty, params.frequency_penalty,
                                           prompt_length))
    return processors


def openai_penalties(presence: float, frequency: float, prompt_length: int) -> LogitsProcessor:
    """OpenAI's presence and frequency penalties: over every token generated so far (the
    prompt does not count), `logit[t] -= frequency * count[t] + presence * (count[t] > 0)`.
    (mlx-lm's own count the last 20 tokens, prompt included.)"""

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        generated = tokens[prompt_length:]
        if generated.size == 0:
            return logits
        counts = mx.zeros((logits.shape[-1],), logits.dtype).at[generated].add(1)
        return logits - (frequency * counts + presence * (counts > 0))

    return process


def token_logprobs(scores: Scores, token: int, tokenizer: ModelTokenizer
                   ) -> tuple[TokenLogprob, tuple[TokenLogprob, ...]]:
    """The sampled token's logprob and the most likely alternatives the request asked
    for, from the scores its step computed."""

    def scored(token: int, logprob: float) -> TokenLogprob:
        return TokenLogprob(token, tokenizer.decode([token]), logprob,
                            tokenizer.token_bytes(token))

    chosen = scored(token, scores.chosen.item())
    if scores.top_ids is None:
        return chosen, ()
    ids, values = scores.top_ids.tolist(), scores.top_values.tolist()
    return chosen, tuple(scored(i, v) for i, v in zip(ids, values))
