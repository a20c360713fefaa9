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

Where the grammar allows few keys (`patternProperties` of a few names), the output can
also be written into a corner: under `^(a|b)$`, after `{"b": 0, "` the token `b` leaves
only `"` to follow, and after `{"a": 0, "b": 1` the comma leaves only keys written. So
from the end of a value in an object, through its comma and its next key, for as long as
that key stays on a written one's bytes, the tokens the grammar allows are looked ahead
through its masks (`GrammarState`), each step read by `toward_key`, and those after
which every way ends in a repeated key are taken out too. Only for grammars whose keys
can run out (`Constraint.bounded_keys`): an open object always has a way out, and the
look-ahead costs a step ~0.2 ms of host time (49k vocabulary, 2-core CPU).

Between JSON values a tool-call grammar writes only its format's markers. The reader takes
a marker with no quote and balanced brackets for no key at all (every format mlx-lm knows
is so; `[TOOL_CALLS]` reads as an empty array), so no marker can make it see a key.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence

import numpy as np

QUOTE, BACKSLASH, COMMA = ord('"'), ord("\\"), ord(",")
WHITESPACE = frozenset(b" \t\n\r")
# Where an output is on its way to its innermost object's next key (`toward_key`): after
# a value, after the comma (or the opening brace), inside the key.
AFTER_VALUE, BEFORE_KEY, IN_KEY = range(3)
OPENING, CLOSING = frozenset(b"{["), frozenset(b"}]")


class KeyTokens:
    """A vocabulary's tokens as they can end a JSON key (those holding a quote) or write
    one further (those holding neither quote nor backslash)."""

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

    # Read only by the look-ahead of grammars whose keys can run out, so made at its first
    # use: ~30 ms for a 49k vocabulary, against ~1 ms for the rest.
    @functools.cached_property
    def plain(self) -> dict[bytes, list[int]]:
        """By their bytes, the tokens with neither quote nor backslash: each writes a key
        further with them."""
        plain: dict[bytes, list[int]] = {}
        for token, data in enumerate(self.token_bytes):
            if data and QUOTE not in data and BACKSLASH not in data:
                plain.setdefault(data, []).append(token)
        return plain

    @functools.cached_property
    def separating(self) -> np.ndarray:
        """The tokens that may stay on the way from a value to the next key (whitespace
        and commas, then at most a quote and anything after it), the longest first."""
        separating = [token for token, data in enumerate(self.token_bytes) if data and all(
            byte in WHITESPACE or byte == COMMA for byte in data.split(b'"', 1)[0])]
        separating.sort(key=lambda token: -len(self.token_bytes[token]))
        return np.array(separating, dtype=np.uint32)


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

    def repeating(self, tokens: KeyTokens) -> list[int]:
        """The tokens that would end the key being written as one its object has."""
        if not self._in_key or not self._stack[-1]:
            return []
        return repeating_after(tokens, bytes(self._string), self._escaped, self._stack[-1])

    def position(self) -> tuple[int, bytes, set[str]] | None:
        """Where the output is on its way to the next key of an object that has keys
        (AFTER_VALUE, BEFORE_KEY or IN_KEY), the key's bytes so far, and the keys; None
        elsewhere, and in a key with a backslash (not looked ahead: a way out is
        assumed)."""
        keys = self._stack[-1] if self._stack else None
        if not keys:
            return None
        if self._string is None:
            return (BEFORE_KEY if self._wants_key else AFTER_VALUE), b"", keys
        if not self._in_key or BACKSLASH in self._string:
            return None
        return IN_KEY, bytes(self._string), keys


def toward_key(phase: int, raw: bytes, data: bytes, keys: set[str]
               ) -> tuple[int, bytes] | bool:
    """Where the token `data` leaves an output at `phase` with the key `raw` so far, on
    its way to a key beside `keys`: the next such position, True where it leaves that way
    (another value, the object's end, a key no written one begins with), False where it
    ends the key as one of `keys`. A backslash in a key counts as a way out."""
    for byte in data:
        if phase == IN_KEY:
            if byte == QUOTE:
                return _decoded(raw) not in keys
            if byte == BACKSLASH:
                return True
            raw += bytes((byte,))
            if not any(key.encode("utf-8", "surrogatepass").startswith(raw) for key in keys):
                return True
        elif byte in WHITESPACE:
            continue
        elif phase == AFTER_VALUE and byte == COMMA:
            phase = BEFORE_KEY
        elif phase == BEFORE_KEY and byte == QUOTE:
            phase, raw = IN_KEY, b""
        else:
            return True
    return phase, raw


def repeating_after(tokens: KeyTokens, raw: bytes, escaped: bool, keys: set[str]) -> list[int]:
    """The tokens that would end a key written as `raw` so far (its last backslash
    escaping the next byte if `escaped`) as one of `keys`."""
    repeating: list[int] = []
    if BACKSLASH in raw:
        candidates = tokens.quoted
    else:
        for key in keys:
            whole = key.encode("utf-8", "surrogatepass")
            if whole.startswith(raw):
                repeating += tokens.by_head.get(whole[len(raw):], ())
        candidates = tokens.escaping
    for token in candidates:
        if _key_closed_by(raw, escaped, tokens.token_bytes[token]) in keys:
            repeating.append(token)
    return repeating


def continuing(tokens: KeyTokens, raw: bytes, keys: set[str]) -> set[int]:
    """The tokens that write a key written as `raw` so far (no backslash in it) further
    along one of `keys`, without ending it."""
    found: set[int] = set()
    for key in keys:
        whole = key.encode("utf-8", "surrogatepass")
        if whole.startswith(raw):
            rest = whole[len(raw):]
            for end in range(1, len(rest) + 1):
                found.update(tokens.plain.get(rest[:end], ()))
    return found


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
