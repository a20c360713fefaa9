"""Per-request samplers, logits processors and logprobs, built on mlx-lm's.

Greedy requests get no sampler of their own (None), so a batch of greedy requests is
sampled with one batched argmax instead of one call per row.
"""

from __future__ import annotations

import hashlib
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
    its own randomness, so a seeded request is reproducible whatever else runs in the
    same batch, whatever the cache holds, and with or without speculative decoding.

    Token i of the output is drawn with the Gumbel-max trick (what `mx.random.categorical`
    does: the argmax of the logits plus Gumbel noise) from noise keyed by the seed and i
    alone, not from a key split once per call. So a speculative step can draw the tokens
    of several positions at once exactly as one step per position would, and keep a draft
    token where it is the one drawn (`draws`): that accepts draft token x with probability
    p(x) and otherwise gives a token distributed as p without x, renormalized, which is
    rejection sampling of a point-mass draft (Leviathan et al. 2023, Chen et al. 2023)
    with its randomness shared with plain decoding."""

    def __init__(self, params: SamplingParams, vocab_size: int) -> None:
        self._filters: list[Callable[[mx.array], mx.array]] = []
        if 0.0 < params.top_p < 1.0:
            self._filters.append(lambda x: apply_top_p(x, params.top_p))
        if params.min_p > 0.0:
            self._filters.append(lambda x: apply_min_p(x, params.min_p))
        if 0 < params.top_k < vocab_size:
            self._filters.append(lambda x: apply_top_k(x, params.top_k))
        self._seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._inverse_temperature = 1.0 / params.temperature
        self.position = 0  # the output index of the next token drawn

    def logits(self, logprobs: mx.array) -> mx.array:
        """The unnormalized log-distribution tokens are drawn from."""
        for apply in self._filters:
            logprobs = apply(logprobs)
        return logprobs * self._inverse_temperature

    def draws(self, logprobs: mx.array, first: int) -> mx.array:
        """The tokens drawn at output positions first, first + 1, ... from each row of
        `logprobs`; advances nothing."""
        noise = mx.stack([mx.random.gumbel(logprobs.shape[-1:], key=self._key(first + i))
                          for i in range(logprobs.shape[0])])
        return mx.argmax(self.logits(logprobs) + noise, axis=-1)

    def __call__(self, logprobs: mx.array) -> mx.array:
        """The next output token, drawn from `logprobs` [1, vocab]."""
        token = self.draws(logprobs, self.position)
        self.position += 1
        return token

    def _key(self, position: int) -> mx.array:
        digest = hashlib.blake2b(f"{self._seed}:{position}".encode(), digest_size=8).digest()
        return mx.random.key(int.from_bytes(digest, "little") >> 1)


def make_sampler(params: SamplingParams, vocab_size: int) -> Sampler | None:
    """The request's sampler; None for greedy."""
    return None if params.greedy else Sampler(params, vocab_size)


def make_processors(params: SamplingParams, prompt_length: int) -> list[LogitsProcessor]:
    """logit_bias and repetition_penalty as mlx-lm applies them; presence and frequency
    penalties as OpenAI defines them (see `openai_penalties`)."""
    if not (params.logit_bias or params.repetition_penalty or params.presence_penalty
            or params.frequency_penalty):
        return []  # most requests: no call into mlx-lm for each of a list's prompts
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

    chosen = tokenizer.token_logprob(token, scores.chosen.item())
    if scores.top_ids is None:
        return chosen, ()
    ids, values = scores.top_ids.tolist(), scores.top_values.tolist()
    return chosen, tuple(tokenizer.token_logprob(i, v) for i, v in zip(ids, values))
