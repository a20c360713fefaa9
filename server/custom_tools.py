"""OpenAI's custom tools (`type: custom`): tools whose input is freeform text.

Chat templates and tool-call formats know functions with JSON arguments, so the model is
shown a custom tool as a function of one string, `input`, and a call's input is read
back out of that function's arguments: whole, or as they stream (`InputReader`). Both
OpenAI APIs that have custom tools (Chat Completions and Responses) share this; each
reads its own shape of the tool into `custom_function`.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from server.request import FunctionTool

INPUT = "input"

# What a call of the function opens with, token by token (JSON whitespace between them),
# up to its one string's first character.
_OPENING = ("{", f'"{INPUT}"', ":", '"')
_JSON_WHITESPACE = " \t\n\r"
_LONGEST_ESCAPE = len("\\uXXXX")
_VALID_ESCAPE = re.compile(r'\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})')
_DECODER = json.JSONDecoder(strict=False)  # a raw newline in the string, as models write it


def custom_function(name: str, description: str | None,
                    grammar: tuple[Literal["lark", "regex"], str] | None) -> FunctionTool:
    """A custom tool as the model is shown it. A grammar (syntax, definition) is shown to
    it; a regular expression also binds a call the request forces, as an anchored JSON
    Schema `pattern` (llguidance reads the Rust regex syntax OpenAI's grammars use)."""
    text: dict[str, Any] = {"type": "string", "description": "The tool's input, as free text."}
    if grammar is not None:
        syntax, definition = grammar
        text["description"] = f"The tool's input: text in this {syntax} grammar:\n{definition}"
        if syntax == "regex":
            text["pattern"] = f"^(?:{definition})$"
    return FunctionTool(name, description, {
        "type": "object", "properties": {INPUT: text},
        "required": [INPUT], "additionalProperties": False}, None)


def custom_arguments(text: str) -> str:
    """A custom call's input as the arguments of the function the model is shown (a call
    sent back in a conversation, rendered by the chat template)."""
    return json.dumps({INPUT: text}, ensure_ascii=False)


def custom_input(arguments: str) -> str:
    """The input a call of a custom tool holds: its one string, as much of it as was
    written where the model ran out of tokens inside it; where the model wrote anything
    but that function's arguments, what it wrote."""
    reader = InputReader()
    return reader.feed(arguments) + reader.finish()


class InputReader:
    """A custom call's input out of its arguments' text as it arrives: what `feed`s and
    `finish` return, joined, is `custom_input` of all the text, so a stream gives the
    input a whole response gives."""

    def __init__(self) -> None:
        self._held = ""  # text not yet given out: the opening so far, or a string's tail
        self._mode: Literal["opening", "string", "raw", "done"] = "opening"

    def feed(self, text: str) -> str:
        if self._mode == "raw":
            return text
        if self._mode == "done":
            return ""
        self._held += text
        if self._mode == "opening":
            self._mode, rest = _read_opening(self._held)
            if self._mode == "opening":
                return ""
            if self._mode == "raw":
                held, self._held = self._held, ""
                return held
            self._held = rest
        return self._read_string()

    def finish(self) -> str:
        """What was held back at the call's end: an opening that never completed, as the
        model wrote it; in the string, a high surrogate whose pair never came (as U+FFFD)
        and not an escape cut off."""
        held, self._held = self._held, ""
        if self._mode == "opening":
            return held
        if self._mode == "string" and _high_surrogate(held[:_LONGEST_ESCAPE]):
            return _decode(held[:_LONGEST_ESCAPE])
        return ""

    def _read_string(self) -> str:
        """Decode the held string text up to where decoding is safe (or its closing
        quote, after which nothing is input)."""
        body, at = self._held, 0
        pieces: list[str] = []  # the body read, an invalid escape made a literal backslash
        safe = (0, 0)  # where decoding may stop: in the body, and in pieces
        while at < len(body):
            char = body[at]
            if char == '"':
                self._mode, self._held = "done", ""
                return _decode("".join(pieces))
            if char == "\\":
                piece = body[at:at + (_LONGEST_ESCAPE if body[at + 1:at + 2] == "u" else 2)]
                if len(piece) < 2 or (piece[1] == "u" and len(piece) < _LONGEST_ESCAPE):
                    break  # cut off inside the escape: wait for the rest
                if not _VALID_ESCAPE.fullmatch(piece):
                    piece = piece[0]  # not JSON's: a backslash the model meant as one
                    pieces.append("\\\\")
                else:
                    pieces.append(piece)
            else:
                piece = char
                pieces.append(piece)
            at += len(piece)
            if not _high_surrogate(piece):
                safe = (at, len(pieces))
        self._held = body[safe[0]:]
        return _decode("".join(pieces[:safe[1]]))


def _read_opening(text: str) -> tuple[Literal["opening", "string", "raw"], str]:
    """Whether `text` is the function's opening (and what follows it), may still become
    it, or cannot."""
    at = 0
    for token in _OPENING:
        while at < len(text) and text[at] in _JSON_WHITESPACE:
            at += 1
        written = text[at:at + len(token)]
        if not token.startswith(written):
            return "raw", ""
        if len(written) < len(token):
            return "opening", ""
        at += len(token)
    return "string", text[at:]


def _high_surrogate(piece: str) -> bool:
    """Is `piece` a high surrogate's escape? Until what follows it is known, it may be
    half of a pair, so the text before it is as far as a stream can decode."""
    return (len(piece) == _LONGEST_ESCAPE and piece[1] == "u"  # \uD800 to \uDBFF
            and piece[2] in "dD" and piece[3] in "89abAB")


def _decode(body: str) -> str:
    """A JSON string's body, its escapes whole and valid, as text; a lone surrogate (half a
    pair, cut off or miswritten) as U+FFFD, since no encoding can send it."""
    text = _DECODER.decode(f'"{body}"')
    return "".join("\ufffd" if "\ud800" <= char <= "\udfff" else char for char in text)
