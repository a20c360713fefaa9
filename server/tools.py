"""Tool calls out of generated text, with the model's own mlx-lm tool parser.

mlx-lm's `TokenizerWrapper` knows each model family's tool-call markers
(`tool_call_start`/`tool_call_end`) and a parser for the text between them; this module
applies them incrementally, so streamed content never shows a marker and each call is
emitted whole as soon as its end marker arrives.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from typing import Any

from server.protocol import FunctionCallOut, ToolCallOut

log = logging.getLogger("radix_mlx.server")

ToolParser = Callable[[str, Any], Any]


class ToolCallParser:
    """Splits one choice's text stream into content and tool calls."""

    def __init__(self, start: str, end: str, parse: ToolParser, tools: list[dict]) -> None:
        self._start, self._end = start, end
        self._parse, self._tools = parse, tools
        self._unparsed = ""
        self._in_call = False
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCallOut]]:
        """Content that is safe to show now, and the calls completed by `text`."""
        self._unparsed += text
        content: list[str] = []
        calls: list[ToolCallOut] = []
        while True:
            if self._in_call:
                at = self._unparsed.find(self._end)
                if at < 0:
                    break
                body, self._unparsed = self._unparsed[:at], self._unparsed[at + len(self._end):]
                self._in_call = False
                parsed = self._parse_call(body)
                if parsed is None:  # keep what the model said rather than drop it
                    content.append(self._start + body + self._end)
                calls.extend(parsed or ())
            else:
                at = self._unparsed.find(self._start)
                if at < 0:
                    # Hold back a tail that may be the first part of a start marker.
                    keep = _marker_prefix_length(self._unparsed, self._start)
                    cut = len(self._unparsed) - keep
                    content.append(self._unparsed[:cut])
                    self._unparsed = self._unparsed[cut:]
                    break
                content.append(self._unparsed[:at])
                self._unparsed = self._unparsed[at + len(self._start):]
                self._in_call = True
        return "".join(content), calls

    def close(self) -> tuple[str, list[ToolCallOut]]:
        """Flush at the end of the choice. Models often stop at EOS without writing the
        end marker, so an unterminated call is still parsed when it parses."""
        rest, self._unparsed = self._unparsed, ""
        if not self._in_call:
            return rest, []
        self._in_call = False
        parsed = self._parse_call(rest)
        return ("", parsed) if parsed is not None else (self._start + rest, [])

    def _parse_call(self, text: str) -> list[ToolCallOut] | None:
        try:
            parsed = self._parse(text, self._tools)
            parsed = parsed if isinstance(parsed, list) else [parsed]
            calls = [_tool_call(call) for call in parsed]
        except Exception as error:  # noqa: BLE001 - model output must never fail the request
            log.warning("unparseable tool call (%s: %s)", type(error).__name__, error)
            return None
        self.calls += len(calls)
        return calls


def _tool_call(call: dict[str, Any]) -> ToolCallOut:
    arguments = call.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCallOut(
        id=call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
        function=FunctionCallOut(name=call["name"], arguments=arguments),
    )


def _marker_prefix_length(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
