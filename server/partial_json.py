"""How much of a tool call's arguments, as a model writes them, is JSON: the SDKs read
a streamed call's input as it comes with jiter's partial mode (pydantic-core's
`from_json(allow_partial=True)`), and refuse the whole stream at a model's first
character that is no JSON (a Python dict's quote, a bare word, a trailing comma)."""

from __future__ import annotations

import re

from pydantic_core import from_json

# A piece of a JSON string that reads wherever the string's text before it does: text
# and whole escapes (not \u's, which jiter reads its own way part-written), maybe an
# escape begun at its end.
STRING_TEXT = re.compile(r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt])*(\\?)')
ESCAPED = '"\\/bfnrt'


def json_start(text: str, known: int = 0) -> str:
    """The longest start of `text` that jiter's partial mode reads, given that its first
    `known` characters do: what follows is no JSON whatever comes after it."""
    if _reads(text):
        return text
    good, bad = known, len(text)
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if _reads(text[:middle]) else (good, middle)
    return text[:good]


class JsonStart:
    """A call's object as it streams, kept to what jiter's partial mode reads: the SDKs
    read all the input_json_deltas so far at each one, and a character past a model's first
    mistake failed the whole stream. A piece inside a string that goes on with the string's
    text (`STRING_TEXT`) reads wherever the text before it did; any other is read with the
    text from its start (reading every piece so took a 30 KB file's content 2.5 s of the
    event loop)."""

    def __init__(self) -> None:
        self.text = ""
        self.broken = False
        self._in_string = self._escaped = False
        # Characters after a \u that jiter must read: its hex digits, and a low surrogate's
        # escape after a high one.
        self._unicode = 0

    def add(self, fragment: str) -> str:
        """What of `fragment` keeps the text JSON: all of it, until the model's mistake."""
        if self.broken:
            return ""
        if not self._goes_on_string(fragment):
            whole = self.text + fragment
            start = json_start(whole, len(self.text))
            self.broken = start != whole
            fragment = start[len(self.text):]
            self._scan(fragment)
        self.text += fragment
        return fragment

    def _goes_on_string(self, fragment: str) -> bool:
        """Is `fragment` more of the string the text ends in? Then it notes whether the
        fragment ends in an escape begun."""
        if not self._in_string or self._unicode:
            return False
        if self._escaped:
            if not fragment or fragment[0] not in ESCAPED:
                return False
            fragment = fragment[1:]
        text = STRING_TEXT.fullmatch(fragment)
        if text is None:
            return False
        self._escaped = bool(text.group(1))
        return True

    def _scan(self, fragment: str) -> None:
        for char in fragment:
            if self._unicode:
                self._unicode -= 1
            if self._escaped:
                self._escaped = False
                if char == "u":
                    self._unicode = 10
            elif char == "\\":
                self._escaped = self._in_string
            elif char == '"':
                self._in_string = not self._in_string


def _reads(text: str) -> bool:
    try:
        from_json(text, allow_partial=True)
    except ValueError:
        return False
    return True
