"""Incremental text for one generation: detokenization and stop strings.

Text that could still turn out to be the start of a stop string is held back, so a stop
string is never emitted, even when it arrives split across several tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TextStream:
    def __init__(self, detokenizer: Any, stop: Sequence[str]) -> None:
        self._detokenizer = detokenizer
        self._detokenizer.reset()
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""  # decoded but not yet emitted
        self.matched_stop: str | None = None

    def add(self, token: int) -> str:
        """Feed one token; return the text that is now safe to emit. After a stop string
        matched, `matched_stop` is set and the text before it is returned."""
        self._detokenizer.add_token(token)
        self._pending += self._detokenizer.last_segment
        return self._release(final=False)

    def finish(self) -> str:
        """Release everything still held back (the stream ended without a stop string)."""
        self._detokenizer.finalize()
        self._pending += self._detokenizer.last_segment
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self._stop:
            hits = [(i, s) for s in self._stop if (i := self._pending.find(s)) >= 0]
            if hits:
                index, self.matched_stop = min(hits)
                text, self._pending = self._pending[:index], ""
                return text
        keep = 0 if final else self._hold
        cut = max(len(self._pending) - keep, 0)
        text, self._pending = self._pending[:cut], self._pending[cut:]
        return text
