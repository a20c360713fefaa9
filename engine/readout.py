"""Prefill-only requests (`api.Readout`): what their prompt's last position gives.

They ride the generation path: admitted, matched against the tree, prefilled (together
with other short prompts) and published like any prompt, their first token "sampled" from
the last position with the scores asked for, then ended at once (max_tokens 0). The
logprobs come from the same distribution the sampled token's logprobs do.

An embedding needs the last hidden state, which the generator reads beside the logits
(hidden_states.py).
"""

from __future__ import annotations

import mlx.core as mx

from engine.api import LastPosition
from engine.generator import Scores
from engine.sampling import token_logprobs
from engine.tokenizer import ModelTokenizer


def last_position(scores: Scores, token: int, tokenizer: ModelTokenizer) -> LastPosition:
    """The `LastPosition` event of a readout's scores."""
    chosen, top = token_logprobs(scores, token, tokenizer)
    asked = tuple(scores.asked.tolist()) if scores.asked is not None else ()
    hidden = tuple(scores.hidden.astype(mx.float32).tolist()) if scores.hidden is not None else ()
    return LastPosition(chosen, top, asked, hidden)
