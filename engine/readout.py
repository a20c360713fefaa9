"""Prefill-only requests (`api.Readout`): what their prompt's last position gives.

A list of them sharing a prefix the tree holds (a classify list's instruction, a rerank
query) is read together: one forward for the batch, nothing cached, every row's scores
read back at once (`Generator.read_together`, `Scheduler._read`). Any other rides the
generation path: admitted, matched against the tree, prefilled (together with other short
prompts) and published like any prompt, its first token "sampled" from the last position
with the scores asked for, then ended at once (max_tokens 0). The logprobs come from the
same distribution the sampled token's logprobs do.

An embedding needs the last hidden state, which the generator reads beside the logits
(hidden_states.py).
"""

from __future__ import annotations

import mlx.core as mx

from engine.api import LastPosition
from engine.generator import Readings, Scores
from engine.tokenizer import ModelTokenizer


def last_position(scores: Scores, token: int, tokenizer: ModelTokenizer) -> LastPosition:
    """The `LastPosition` event of one generation's scores."""

    def values(array: mx.array | None) -> list[list]:
        return [array.tolist() if array is not None else []]

    hidden = scores.hidden.astype(mx.float32) if scores.hidden is not None else None
    readings = Readings([token], [scores.chosen.item()], values(scores.top_ids),
                        values(scores.top_values), values(scores.asked), values(hidden))
    return last_positions(readings, tokenizer)[0]


def last_positions(readings: Readings, tokenizer: ModelTokenizer) -> list[LastPosition]:
    """The `LastPosition` event of each row read."""
    return [LastPosition(tokenizer.token_logprob(token, logprob),
                         tuple(map(tokenizer.token_logprob, ids, values)),
                         tuple(asked), tuple(hidden))
            for token, logprob, ids, values, asked, hidden in zip(
                readings.tokens, readings.logprobs, readings.top_ids,
                readings.top_logprobs, readings.asked, readings.hidden)]
