"""Tool-call splitting with mlx-lm's real JSON tool parser (the random-weight demo model
never writes a tool call, so the parser is driven with text here)."""

from __future__ import annotations

import json

from mlx_lm.tool_parsers import json_tools

from server.tools import ToolCallParser


def _parser() -> ToolCallParser:
    return ToolCallParser(
        json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call, []
    )


def _run(pieces: list[str]) -> tuple[str, list]:
    parser = _parser()
    content, calls = "", []
    for piece in pieces:
        text, new = parser.feed(piece)
        content += text
        calls += new
    text, new = parser.close()
    return content + text, calls + new


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_call_split_into_single_characters() -> None:
    content, calls = _run(list("Let me check. " + CALL + " Done."))
    assert content == "Let me check.  Done."
    assert [(call.function.name, json.loads(call.function.arguments)) for call in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert calls[0].id.startswith("call_") and calls[0].type == "function"


def test_two_calls_and_the_count() -> None:
    parser = _parser()
    text, calls = parser.feed(CALL + CALL.replace("Paris", "Oslo"))
    assert text == "" and len(calls) == 2 and parser.calls == 2


def test_partial_start_marker_is_held_back_then_released() -> None:
    parser = _parser()
    assert parser.feed("a <tool") == ("a ", [])
    assert parser.feed("box>") == ("<toolbox>", [])


def test_unterminated_call_is_parsed_at_close() -> None:
    parser = _parser()
    assert parser.feed('<tool_call>{"name": "f", "arguments": {}}') == ("", [])
    text, calls = parser.close()
    assert text == "" and calls[0].function.name == "f" and calls[0].function.arguments == "{}"


def test_unparseable_call_stays_as_content() -> None:
    content, calls = _run(["<tool_call>not json</tool_call> after"])
    assert content == "<tool_call>not json</tool_call> after" and calls == []
