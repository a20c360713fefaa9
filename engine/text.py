"""Incremental text for one generation: detokenization and stop strings.

Each new token's text is the difference between decoding a short window of tokens with
and without it (vLLM's incremental detokenization). The window starts with the last few
prompt tokens, so the first generated token keeps its leading space, which decoding it
alone would drop for many tokenizers. A token that ends inside a multi-byte character
shows no text until the character is complete.

Text that could still turn out to be the start of a stop string is held back, so a stop
string is never emitted, even when it arrives split across several tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Prompt tokens decoded ahead of the first generated one, for context.
CONTEXT_TOKENS = 5


class TextStream:
    def __init__(self, tokenizer: Any, prompt: Sequence[int], stop: Sequence[str]) -> None:
        self._decode = tokenizer.decode
        self._tokens = list(prompt[-CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._held = ""  # decoded, not yet emitted (a stop string may start in it)
        self.matched_stop: str | None = None

    def add(self, token: int) -> str:
        """Feed one token; return the text that is now safe to emit. After a stop string
        matched, `matched_stop` is set and the text before it is returned."""
        self._tokens.append(token)
        self._held += self._new_text()
        return self._release(final=False)

    def finish(self) -> str:
        """Release everything still held back (the stream ended without a stop string)."""
        self._held += self._new_text(final=True)
        return self._release(final=True)

    def _new_text(self, final: bool = False) -> str:
        window = self._tokens[self._prefix_offset:]
        before = self._decode(self._tokens[self._prefix_offset:self._read_offset],
                              skip_special_tokens=True)
        after = self._decode(window, skip_special_tokens=True)
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""  # nothing new yet, or an incomplete character
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return after[len(before):]

    def _release(self, final: bool) -> str:
        if self._stop:
            hits = [(i, s) for s in self._stop if (i := self._held.find(s)) >= 0]
            if hits:
                index, self.matched_stop = min(hits)
                text, self._held = self._held[:index], ""
                return text
        keep = 0 if final else self._hold
        cut = max(len(self._held) - keep, 0)
        text, self._held = self._held[:cut], self._held[cut:]
        return text
