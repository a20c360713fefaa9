"""Duplicate keys: what a JSON grammar cannot forbid, forbidden token by token.

llguidance writes each property an object lists at most once, but the other keys an open
object allows (`additionalProperties` true or a schema, `patternProperties`, every object
of `json_object`) may repeat: keeping an unbounded set of keys distinct is beyond any
context-free grammar. A small model that runs out of things to say then repeats a key
until max_tokens, and RFC 8259 leaves the meaning of a repeated key undefined (many
clients reject it, others keep the last value).

So each constrained sequence also reads its output as JSON (`JsonKeys`), knowing the keys
written so far in every object it is inside; while a key is being written, the tokens that
would close it as one of those are taken out of the grammar's mask (`JsonKeys.repeating`).
Keys compare as the strings they stand for: `"\\u000a"` repeats `"\\n"`.

Between JSON values a tool-call grammar writes only its format's markers. The reader takes
a marker with no quote and balanced brackets for no key at all (every format mlx-lm knows
is so; `[TOOL_CALLS]` reads as an empty array), so no marker can make it see a key.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

QUOTE, BACKSLASH = ord('"'), ord("\\")
OPENING, CLOSING = frozenset(b"{["), frozenset(b"}]")


class ClosingTokens:
    """A vocabulary's tokens that hold a quote, the ones that can end a JSON string."""

    def __init__(self, token_bytes: Sequence[bytes]) -> None:
        self.token_bytes = token_bytes
        self.quoted = [token for token, data in enumerate(token_bytes) if QUOTE in data]
        # By the bytes before their first quote, for those with no backslash there: each
        # closes a string with those bytes, whatever came before (no escape is open once
        # a key holds no backslash).
        self.by_head: dict[bytes, list[int]] = {}
        # The others, whose first quote may be escaped: read one by one.
        self.escaping: list[int] = []
        for token in self.quoted:
            head = token_bytes[token].split(b'"', 1)[0]
            if BACKSLASH in head:
                self.escaping.append(token)
            else:
                self.by_head.setdefault(head, []).append(token)


class JsonKeys:
    """What one JSON output says so far, as far as its objects' keys go."""

    def __init__(self) -> None:
        # The containers the output is inside: an object's keys so far, or None (array).
        self._stack: list[set[str] | None] = []
        self._wants_key = False  # the innermost object's next string is a key
        self._string: bytearray | None = None  # the raw bytes of the string being written
        self._in_key = False
        self._escaped = False  # the string's last byte is a backslash that escapes

    def feed(self, data: bytes) -> None:
        for byte in data:
            if self._string is not None:
                if self._escaped:
                    self._escaped = False
                elif byte == BACKSLASH:
                    self._escaped = True
                elif byte == QUOTE:
                    self._end_string()
                    continue
                self._string.append(byte)
            elif byte == QUOTE:
                self._string, self._in_key = bytearray(), self._wants_key
            elif byte in OPENING:
                self._stack.append(set() if byte == ord("{") else None)
                self._wants_key = byte == ord("{")
            elif byte in CLOSING:
                if self._stack:
                    self._stack.pop()
                self._wants_key = False
            elif byte == ord(","):
                self._wants_key = bool(self._stack) and self._stack[-1] is not None

    def _end_string(self) -> None:
        if self._in_key and (key := _decoded(bytes(self._string))) is not None:
            self._stack[-1].add(key)
        self._string, self._in_key, self._wants_key = None, False, False

    def repeating(self, closing: ClosingTokens) -> list[int]:
        """The tokens that would end the key being written as one its object has."""
        if not self._in_key or not self._stack[-1]:
            return []
        keys, raw = self._stack[-1], bytes(self._string)
        repeating: list[int] = []
        if BACKSLASH in raw:
            candidates = closing.quoted
        else:
            for key in keys:
                whole = key.encode("utf-8", "surrogatepass")
                if whole.startswith(raw):
                    repeating += closing.by_head.get(whole[len(raw):], ())
            candidates = closing.escaping
        for token in candidates:
            if _key_closed_by(raw, self._escaped, closing.token_bytes[token]) in keys:
                repeating.append(token)
        return repeating


def _key_closed_by(raw: bytes, escaped: bool, data: bytes) -> str | None:
    """The key that `data` ends, written after `raw` (whose last backslash escapes the
    next byte if `escaped`); None if `data` does not end it."""
    for end, byte in enumerate(data):
        if escaped:
            escaped = False
        elif byte == BACKSLASH:
            escaped = True
        elif byte == QUOTE:
            return _decoded(raw + data[:end])
    return None


def _decoded(raw: bytes) -> str | None:
    """The string a JSON string literal's inside `raw` stands for; None if it is not
    one (bytes that are not UTF-8, say), which then compares equal to no key."""
    try:
        return json.loads(b'"' + raw + b'"')
    except ValueError:
        return None
