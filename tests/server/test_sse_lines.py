"""SSE responses: every event stays on one line for line readers that split on more than
CR and LF (str.splitlines, and so httpx's aiter_lines, also split on U+0085, U+2028 and
U+2029, which JSON allows raw in strings: a model writing one broke the client's JSON), is
framed as sse-starlette framed it (CRLF line ends, a blank line after each event), and the
response pings while it waits, ends cleanly, and ends at once when its client leaves.
(Through real servers: tests/server/test_api.py, test_lifecycle.py.)"""

from __future__ import annotations

import asyncio
import json

from server.http.streaming import GenerationEventSource, NamedEvent, frame

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


class GenerationRun:
    """What a response needs of its generation: to be closed."""

    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


async def _respond(events, receive, ping_seconds: float) -> tuple[list[dict], GenerationRun]:
    generation, sent = GenerationRun(), []

    async def send(message: dict) -> None:
        sent.append(message)

    response = GenerationEventSource(generation, events, ping_seconds=ping_seconds)
    await response({"type": "http"}, receive, send)
    return sent, generation


async def _never_disconnects() -> dict:
    await asyncio.Event().wait()
    return {}


async def test_pings_while_waiting_then_events_then_the_end_and_nothing_after() -> None:
    async def events():
        await asyncio.sleep(0.25)  # a long prompt computed before the first token
        yield "first"
        yield ["second", "[DONE]"]  # ready together: one write

    sent, generation = await _respond(events(), _never_disconnects, ping_seconds=0.05)
    start, *bodies, end = sent
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert end == {"type": "http.response.body", "body": b"", "more_body": False}
    pings = [body["body"] for body in bodies if body["body"].startswith(b": ping")]
    assert len(pings) >= 2 and all(ping.endswith(b"\r\n\r\n") for ping in pings)
    data = [body["body"] for body in bodies if not body["body"].startswith(b": ping")]
    assert data == [b"data: first\r\n\r\n", b"data: second\r\n\r\ndata: [DONE]\r\n\r\n"]
    assert generation.closed == 1


async def test_a_disconnect_before_the_first_event_ends_the_response() -> None:
    cleaned_up = asyncio.Event()

    async def events():
        try:
            await asyncio.Event().wait()  # waiting in the engine's queue
            yield "never"
        finally:
            cleaned_up.set()

    async def receive() -> dict:
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    sent, generation = await asyncio.wait_for(_respond(events(), receive, ping_seconds=15),
                                              timeout=5)
    assert [message["type"] for message in sent] == ["http.response.start"]
    assert generation.closed == 1 and cleaned_up.is_set()
