"""Tool calls split out of streamed text, with mlx-lm's real JSON tool parser (the
random-weight demo model never writes a tool call, so the parser is driven with text)."""

from __future__ import annotations

import json

from mlx_lm.tool_parsers import json_tools

from engine.api import Finish, TokenEvent, TokenLogprob
from engine.tokenizer import ToolCallFormat
from server.events import Event, TextDelta, ToolCallArguments, ToolCallStarted, Usage
from server.pipeline import ChoiceDecoder
from server.tools import ToolCallParser

JSON_FORMAT = ToolCallFormat(
    json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call
)


def _run(
    pieces: list[str], tool_format: ToolCallFormat = JSON_FORMAT, parallel: bool = True
) -> list[Event]:
    parser = ToolCallParser(0, tool_format, [], parallel)
    events: list[Event] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.close()


def _text(events: list[Event]) -> str:
    return "".join(event.text for event in events if isinstance(event, TextDelta))


def _calls(events: list[Event]) -> list[tuple[str, dict]]:
    calls: dict[int, list] = {}
    for event in events:
        if isinstance(event, ToolCallStarted):
            calls[event.index] = [event.name, ""]
        elif isinstance(event, ToolCallArguments):
            calls[event.index][1] += event.fragment
    return [(name, json.loads(arguments)) for name, arguments in calls.values()]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_call_split_into_single_characters_streams_its_arguments() -> None:
    events = _run(list("Let me check. " + CALL + " Done."))
    assert _text(events) == "Let me check.  Done."
    assert _calls(events) == [("get_weather", {"city": "Paris"})]
    started = [event for event in events if isinstance(event, ToolCallStarted)]
    assert started[0].id.startswith("call_")
    fragments = [event for event in events if isinstance(event, ToolCallArguments)]
    # The name comes first, then the arguments in as many pieces as they arrived.
    assert events.index(started[0]) < events.index(fragments[0])
    assert len(fragments) == len('{"city": "Paris"}')


def test_two_calls_are_numbered() -> None:
    events = _run([CALL + CALL.replace("Paris", "Oslo")])
    assert _text(events) == ""
    assert _calls(events) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    assert [e.index for e in events if isinstance(e, ToolCallStarted)] == [0, 1]


def test_blank_text_between_and_after_calls_is_not_content() -> None:
    """Hermes/Qwen put a newline between parallel calls; models end lines out of habit.
    (Blank text before the first call is released before a call is known to follow.)"""
    events = _run(list("\n" + CALL + "\n" + CALL.replace("Paris", "Oslo") + "\n\n"))
    assert [e for e in events if isinstance(e, TextDelta)] == [TextDelta(0, "\n")]
    assert len(_calls(events)) == 2
    assert _text(_run([CALL + "\n", "\nDone."])) == "\n\nDone."


def test_without_parallel_calls_only_the_first_is_kept() -> None:
    events = _run(list("a" + CALL + "b" + CALL.replace("Paris", "Oslo") + "c"), parallel=False)
    assert _calls(events) == [("get_weather", {"city": "Paris"})] and _text(events) == "abc"


def test_braces_and_markers_inside_argument_strings() -> None:
    call = '<tool_call>{"name": "f", "arguments": {"s": "}{ \\" </tool"}}</tool_call>'
    assert _calls(_run(list(call))) == [("f", {"s": '}{ " </tool'})]


def test_the_end_marker_inside_an_argument_string_is_text_of_the_argument() -> None:
    """An agent's edit of a file about tool calls, or a forced call whose schema allows
    the marker in a string: the call ends at the marker after its arguments, whole,
    however the text arrives."""
    call = ('<tool_call>\n{"name": "f", "arguments": {"x": "a</tool_call>b", "y": 1}}'
            '\n</tool_call>after')
    for pieces in ([call], list(call), [call[:40], call[40:60], call[60:]]):
        events = _run(pieces)
        assert _calls(events) == [("f", {"x": "a</tool_call>b", "y": 1})]
        assert _text(events) == "after"


def test_the_end_marker_inside_the_name_is_text_of_the_name() -> None:
    """A tool named with the marker in it (a chat's names are free text): a forced call of
    it was content, and no call."""
    call = '<tool_call>\n{"name": "a</tool_call>", "arguments": {"y": 1}}\n</tool_call>after'
    for pieces in ([call], list(call), [call[:20], call[20:30], call[30:]]):
        events = _run(pieces)
        assert _calls(events) == [("a</tool_call>", {"y": 1})]
        assert _text(events) == "after"


def test_partial_start_marker_is_held_back_then_released() -> None:
    parser = ToolCallParser(0, JSON_FORMAT, [])
    assert parser.feed("a <tool") == [TextDelta(0, "a ")]
    assert parser.feed("box>") == [TextDelta(0, "<toolbox>")]


def test_unterminated_call_is_a_call_at_close() -> None:
    assert _calls(_run(['<tool_call>{"name": "f", "arguments": {}}'])) == [("f", {})]


def test_a_call_cut_short_by_max_tokens_leaves_no_marker_in_content() -> None:
    parser = ToolCallParser(0, JSON_FORMAT, [])
    assert parser.feed('Sure.<tool_call>\n{"name": "get_') == [TextDelta(0, "Sure.")]
    assert parser.close(cut=True) == []
    parser = ToolCallParser(0, JSON_FORMAT, [])
    assert parser.feed("Sure.<tool_") == [TextDelta(0, "Sure.")]
    assert parser.close(cut=True) == []


def test_other_formats_are_parsed_whole_at_the_end_marker() -> None:
    def parse(text: str, tools: object) -> dict:
        name, _, city = text.partition(":")
        return {"name": name, "arguments": {"city": city}}

    events = _run(["x[CALL]get_weather:", "Oslo[/CALL]"], ToolCallFormat("[CALL]", "[/CALL]", parse))
    assert _text(events) == "x" and _calls(events) == [("get_weather", {"city": "Oslo"})]


def test_unparseable_call_stays_as_content() -> None:
    events = _run(["<tool_call>not json</tool_call> after"])
    assert _text(events) == "<tool_call>not json</tool_call> after" and _calls(events) == []


def _logprob_texts(pieces: list[str], cut: bool = False) -> tuple[str, list[str]]:
    """The answer's text and the tokens its logprobs cover, one token a piece."""
    decoder = ChoiceDecoder(0, None, ToolCallParser(0, JSON_FORMAT, []), logprobs=True)
    events: list[Event] = []
    for token, piece in enumerate(pieces):
        events += decoder.token(
            TokenEvent(token, piece, TokenLogprob(token, piece, -1.0, piece.encode())))
    events += decoder.finish(Finish("length" if cut else "stop", "", 10, len(pieces), 0),
                             Usage(10, len(pieces)))
    texts = [event for event in events if isinstance(event, TextDelta)]
    return ("".join(event.text for event in texts),
            [token.text for event in texts for token in event.tokens])


def test_logprobs_cover_the_answers_tokens_not_a_calls_marker() -> None:
    """A call's start marker is held back until it is whole; the tokens that wrote it are
    the call's, not the answer's, so their logprobs are not the answer's either."""
    call = ["<", "tool", "_call", ">\n", '{"name": "f", ', '"arguments": {}}', "\n</tool_call>"]
    assert _logprob_texts(["Check", "ing.", "\n", *call]) == (
        "Checking.\n", ["Check", "ing.", "\n"])
    assert _logprob_texts(call) == ("", [])
    # Held back as a marker's beginning, then text after all: its tokens are the text's.
    assert _logprob_texts(["a ", "<", "tool", "box>"]) == ("a <toolbox>", ["a ", "<", "tool", "box>"])
    assert _logprob_texts(["a ", "<", "tool"]) == ("a <tool", ["a ", "<", "tool"])
    # A token that writes nothing (part of a character) still has its logprob.
    assert _logprob_texts(["x", "", "y"]) == ("xy", ["x", "", "y"])
