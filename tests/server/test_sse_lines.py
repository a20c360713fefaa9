"""Every SSE event stays on one line for line readers that split on more than CR and LF
(str.splitlines, and so httpx's aiter_lines, also split on U+0085, U+2028 and U+2029,
which JSON allows raw in strings: a model writing one broke the client's JSON), and is
framed as sse-starlette framed it (CRLF line ends, a blank line after each event)."""

from __future__ import annotations

import json

from server.streaming import NamedEvent, frame

TEXT = "line\x85next\u2028para\u2029end"


def test_each_event_is_one_line_and_decodes_to_the_same_text() -> None:
    data = frame(json.dumps({"delta": TEXT}, ensure_ascii=False)).decode()
    assert data.endswith("\r\n\r\n") and len(data.splitlines()) == 2  # the line, the blank
    assert data.startswith("data: ") and json.loads(data[6:])["delta"] == TEXT

    named = frame(NamedEvent("delta", json.dumps({"text": TEXT}, ensure_ascii=False)))
    event, data, blank, *rest = named.decode().splitlines()
    assert event == "event: delta" and blank == "" and rest == []
    assert json.loads(data.removeprefix("data: "))["text"] == TEXT


def test_openai_events_are_framed_as_before() -> None:
    assert frame("[DONE]") == b"data: [DONE]\r\n\r\n"
    assert frame(NamedEvent("ping", '{"type":"ping"}')) == (
        b'event: ping\r\ndata: {"type":"ping"}\r\n\r\n')
