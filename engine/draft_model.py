"""A draft model for speculative decoding: a small model of the served model's tokenizer
guesses a sequence's next tokens greedily, as mlx-lm's `speculative_generate_step` does
for one stream; the served model verifies them like any draft (generator.py `_verify`).

Each drafting sequence keeps its own cache in the draft model (`DraftSession`): caught up
on the tokens it has not seen, trimmed back to where the sequence parted from its last
guess. Sessions run one after another on the engine's thread, each guess one evaluation
of a lazily built chain of one-token forwards.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from engine.loader import LoadedModel, load_model
from engine.mlx_lm_internals import supports_segments
from radix.prefix import common_prefix_length

CATCH_UP_CHUNK = 512  # tokens a session feeds the draft model per forward when catching up


class DraftModelError(ValueError):
    """The draft model cannot draft for the served model."""


class DraftModel:
    """A loaded draft model, checked against the model it drafts for."""

    def __init__(self, model: nn.Module, weight_bytes: int, vocab_size: int) -> None:
        self.model = model
        self.weight_bytes = weight_bytes
        self.vocab_size = vocab_size  # its embedding's rows

    @classmethod
    def load(cls, path: str, target: LoadedModel) -> DraftModel:
        """Load `path` (a local directory or hub repo id) with mlx-lm; refuse a model whose
        tokenizer maps text to other ids than `target`'s, that embeds fewer ids than the
        tokenizer makes (MLX does not check an index: a larger id reads other memory), or
        whose cache cannot be rolled back (a sliding window or recurrent state)."""
        draft = load_model(path)
        theirs, ours = draft.tokenizer.vocabulary(), target.tokenizer.vocabulary()
        if theirs != ours:
            differing = len(set(theirs.items()) ^ set(ours.items()))
            raise DraftModelError(
                f"the draft model {draft.model_id} has another tokenizer than "
                f"{target.model_id} ({len(theirs)} against {len(ours)} tokens, "
                f"{differing} entries differ): its token ids would mean other text")
        if draft.vocab_size < target.tokenizer.vocab_size:
            raise DraftModelError(
                f"the draft model {draft.model_id} embeds {draft.vocab_size} token ids, "
                f"fewer than the {target.tokenizer.vocab_size} its tokenizer makes")
        if not supports_segments(make_prompt_cache(draft.model)):
            raise DraftModelError(f"the draft model {draft.model_id} keeps a cache that "
                                  "cannot be rolled back (sliding window or recurrent)")
        return cls(draft.model, draft.weight_bytes, draft.vocab_size)

    def session(self) -> DraftSession:
        return DraftSession(self.model, self.vocab_size)


class DraftSession:
    """One sequence's drafting: a cache of the draft model and the tokens it holds."""

    def __init__(self, model: nn.Module, vocab_size: int) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.cache = make_prompt_cache(model)
        self.tokens: list[int] = []

    def __call__(self, context: list[int], limit: int) -> list[int]:
        """The draft model's greedy `limit` tokens after `context`; none where the context
        holds an id past the draft model's embedding (a served model's padding row, which
        sampling or a logit bias can pick)."""
        if not context or limit <= 0:
            return []
        # The last token is fed again for its logits, whatever the cache holds.
        kept = min(common_prefix_length(self.tokens, context), len(context) - 1)
        if max(context[kept:]) >= self.vocab_size:
            return []
        trim_prompt_cache(self.cache, len(self.tokens) - kept)
        *unseen, last = context[kept:]
        for start in range(0, len(unseen), CATCH_UP_CHUNK):
            self.model(mx.array(unseen[start:start + CATCH_UP_CHUNK])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
        token = mx.array([last])
        guessed = []
        for _ in range(limit):
            token = mx.argmax(self.model(token[None], cache=self.cache)[:, -1, :], axis=-1)
            guessed.append(token)
        drafted = mx.concatenate(guessed).tolist()
        self.tokens = context + drafted[:-1]  # the last guess was never fed
        return drafted
