"""Tool calls out of generated text, streamed as they are written.

A model writes a call between its format's markers (`tool_call_start`/`tool_call_end`,
which mlx-lm's `TokenizerWrapper` knows per model family, or the generic format's, see
`server.generic_tools`). Most formats put `{"name": ..., "arguments": {...}}` between
them: such a call is streamed, `ToolCallStarted` as soon as its name is complete, then
the arguments object's text as it arrives. Any other format is parsed whole with the
family's mlx-lm parser when its end marker arrives. Content never shows a marker, nor
the blank text between and after calls (a format's separator, a model's last newline):
OpenAI's calls come without content.
"""

from __future__ import annotations

import json
import logging
import re
import uuid

from engine.tokenizer import ToolCallFormat
from server.events import Event, TextDelta, ToolCallArguments, ToolCallStarted
from server.markers import split_at

log = logging.getLogger("radix_mlx.server")

# The head of a call in the common JSON format, up to the arguments object's `{`.
JSON_CALL_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)
# The same head cut off inside the name's string.
JSON_CALL_NAME_OPEN = re.compile(r'\s*\{\s*"name"\s*:\s*"(?:[^"\\]|\\.)*\\?\Z')


def new_call_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    """Splits one choice's answer text into `TextDelta`s and tool-call events."""

    def __init__(
        self, choice: int, tool_format: ToolCallFormat, tools: list[dict], parallel: bool = True,
        forced: str | None = None, id_prefix: str = "call_",
    ) -> None:
        """`parallel` False: at most one call (OpenAI's parallel_tool_calls); any further
        call the model writes is dropped. `forced`: the function a forced call must be of
        (`server.structured.forced_function`), whose call, cut short before its name was
        written, is still that call. `id_prefix`: how the ids given to calls begin."""
        self.choice = choice
        self._format, self._tools, self._parallel = tool_format, tools, parallel
        self._forced, self._id_prefix = forced, id_prefix
        self._buffer = ""  # text held back: maybe the start of a marker
        self._blank = ""  # blank text held back after a call: content only if text follows
        self._in_call = False
        self._body = ""  # the current call's text so far
        self._arguments: _JsonValueEnd | None = None  # set while a call's arguments stream
        self.calls = 0

    @property
    def in_call(self) -> bool:
        return self._in_call

    @property
    def holding(self) -> bool:
        """Is answer text held back: maybe a call's start marker, or blank text after a
        call that is content only if more text follows?"""
        return not self._in_call and bool(self._buffer or self._blank)

    def feed(self, text: str) -> list[Event]:
        """The events `text` completes; a possible marker's beginning is held back."""
        self._buffer += text
        events: list[Event] = []
        while True:
            marker = self._format.end if self._in_call else self._format.start
            released, self._buffer, found = split_at(self._buffer, marker)
            if self._in_call:
                events += self._call_text(released)
                if found and self._in_json_string:
                    # The end marker as text of an argument ("</tool_call>" in a file an
                    # agent edits) or of the name: JSON has it in a string, and so may a
                    # forced call's grammar. The call goes on.
                    events += self._call_text(marker)
                    continue
                if found:
                    events += self._end_call(terminated=True)
            else:
                events += self._content(released)
                if found:
                    self._blank = ""
            if not found:
                return events
            self._in_call = not self._in_call

    def _content(self, text: str) -> list[Event]:
        if self.calls and not (self._blank + text).strip():
            self._blank += text
            return []
        text, self._blank = self._blank + text, ""
        return [TextDelta(self.choice, text)] if text else []

    def close(self, cut: bool = False) -> list[Event]:
        """Flush at the end of the choice. Models often stop at EOS without writing the
        end marker, so an unterminated call is still a call when it parses. `cut`: the
        choice ran out of tokens, so an unterminated call that does not parse, or the
        beginning of a start marker held back, was a call cut short: it is dropped (a
        call whose name was complete stays, its arguments cut short as OpenAI's are)."""
        rest, self._buffer = self._buffer, ""
        # A forced call's marker or head begun, not its name: OpenAI's call comes with its
        # name (the function's, which was never in doubt) and the arguments written: none.
        nameless = (cut and self._forced is not None and not self.calls
                    and (self._in_call or rest))
        if not self._in_call:
            return self._forced_call() if nameless else self._content("" if cut else rest)
        self._in_call = False
        events = self._call_text(rest)
        if nameless and self._arguments is None:  # what was held back gave no name either
            self._body = ""
            return events + self._forced_call()
        return events + self._end_call(terminated=False, cut=cut)

    def _forced_call(self) -> list[Event]:
        self.calls += 1
        return [ToolCallStarted(self.choice, 0, new_call_id(self._id_prefix), self._forced)]

    def _call_text(self, text: str) -> list[Event]:
        if self._dropping:
            return []
        self._body += text
        if self._arguments is not None:
            return self._stream_arguments(text)
        head = JSON_CALL_HEAD.match(self._body)
        if head is None:
            return []  # not (yet) the JSON format: parsed whole at the end marker
        try:
            name = json.loads(f'"{head.group(1)}"')
        except json.JSONDecodeError:
            return []
        self._arguments = _JsonValueEnd()
        started = ToolCallStarted(self.choice, self.calls, new_call_id(self._id_prefix), name)
        return [started, *self._stream_arguments(self._body[head.end():])]

    def _stream_arguments(self, text: str) -> list[Event]:
        assert self._arguments is not None
        fragment = text[:self._arguments.feed(text)]
        return [ToolCallArguments(self.choice, self.calls, fragment)] if fragment else []

    @property
    def _in_json_string(self) -> bool:
        if self._arguments is not None:
            return self._arguments.in_string
        return JSON_CALL_NAME_OPEN.match(self._body) is not None

    @property
    def _dropping(self) -> bool:
        return not self._parallel and self.calls > 0

    def _end_call(self, terminated: bool, cut: bool = False) -> list[Event]:
        if self._dropping:
            return []
        body, self._body = self._body, ""
        if self._arguments is not None:
            self._arguments = None
            self.calls += 1
            return []
        calls = self._parse(body)
        if calls is None:  # keep what the model said rather than drop it
            if cut:
                return []
            end = self._format.end if terminated else ""
            return [TextDelta(self.choice, self._format.start + body + end)]
        events: list[Event] = []
        for name, arguments, call_id in calls[:None if self._parallel else 1]:
            events.append(ToolCallStarted(self.choice, self.calls, call_id, name))
            events.append(ToolCallArguments(self.choice, self.calls, arguments))
            self.calls += 1
        return events

    def _parse(self, body: str) -> list[tuple[str, str, str]] | None:
        """(name, arguments JSON, id) of each call in `body`, or None if it does not parse."""
        try:
            parsed = self._format.parse(body, self._tools)
            parsed = parsed if isinstance(parsed, list) else [parsed]
            calls = []
            for call in parsed:
                arguments = call.get("arguments", {})
                if not isinstance(arguments, str):
                    arguments = json.dumps(arguments, ensure_ascii=False)
                calls.append((str(call["name"]), arguments, call.get("id") or new_call_id(self._id_prefix)))
        except Exception as error:  # noqa: BLE001 - model output must never fail the request
            log.warning("unparseable tool call (%s: %s)", type(error).__name__, error)
            return None
        return calls


class _JsonValueEnd:
    """Finds where a JSON object or array that arrives in pieces ends."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = self.done = False

    def feed(self, text: str) -> int:
        """How many leading characters of `text` belong to the value."""
        if self.done:
            return 0
        for at, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return at + 1
        return len(text)
