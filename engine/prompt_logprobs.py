"""Prompt logprobs: each prompt token's logprob given the tokens before it, as scoring
tools (lm-evaluation-harness's loglikelihood, perplexity) ask for with `echo`.

They are computed by a forward of their own over the whole prompt, from a fresh cache,
not by the request's prefill: the prefill starts after the longest cached prefix, whose
positions produce no logits, so a cache hit would leave those tokens without logprobs
(vLLM reports none for them). The scoring forward gives every prompt token its logprob
whatever the cache holds, and the request's own prefill still reuses the cached prefix.
It costs one prefill of the prompt more, computed a chunk per engine step before the
request is admitted (`PromptScoring`), so a long prompt holds up no step by more than a
chunk, and a request cancelled meanwhile stops being scored at the next step.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn
from mlx_lm.models.cache import make_prompt_cache

from engine.api import TokenEvent
from engine.tokenizer import ModelTokenizer


class PromptScoring:
    """A prompt's logprobs, computed `advance` by `advance` over a cache of its own. When
    `done`, `events` holds one `TokenEvent` per prompt token, its text the token's own: the
    first has no logprob (nothing comes before it), every other its logprob under the
    model given the tokens before it and the `top` likeliest tokens at its position."""

    def __init__(self, model: nn.Module, tokenizer: ModelTokenizer, tokens: list[int],
                 top: int) -> None:
        self._model = model
        self._tokenizer = tokenizer
        self._tokens = tokens
        self._top = top
        self._cache = make_prompt_cache(model)
        self._scored = 0  # positions fed so far: the tokens after them are scored
        self.events = [TokenEvent(tokens[0], tokenizer.decode([tokens[0]]))]

    @property
    def done(self) -> bool:
        return self._scored >= len(self._tokens) - 1

    def advance(self, chunk: int) -> None:
        """Score the next `chunk` tokens (in one forward)."""
        start, tokens, top = self._scored, self._tokens, self._top
        fed = tokens[start:min(start + chunk, len(tokens) - 1)]
        targets = tokens[start + 1:start + 1 + len(fed)]
        logits = self._model(mx.array([fed]), cache=self._cache)[0].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(logprobs, mx.array(targets)[:, None], axis=-1)[:, 0]
        arrays = [chosen]
        if top:
            ids = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top]
            values = mx.take_along_axis(logprobs, ids, axis=-1)
            order = mx.argsort(-values, axis=-1)
            arrays += [mx.take_along_axis(ids, order, axis=-1),
                       mx.take_along_axis(values, order, axis=-1)]
        mx.eval(arrays, [c.state for c in self._cache])
        rows = zip(*(array.tolist() for array in arrays))
        for token, (logprob, *alternatives) in zip(targets, rows):
            own = self._tokenizer.token_logprob(token, logprob)
            best = tuple(self._tokenizer.token_logprob(i, v) for i, v in zip(*alternatives))
            self.events.append(TokenEvent(token, own.text, own, best))
        self._scored += len(fed)
