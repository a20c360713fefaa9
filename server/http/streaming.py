"""Ending a generation's HTTP response cleanly, for every front end: an SSE response
that closes its generation however it ends, and a non-streaming wait that notices a
client that went away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from server.pipeline import GenerationRun

T = TypeVar("T")

# nginx's "client closed request": logged for a non-streaming request whose client left.
CLIENT_CLOSED = 499

# Proxies drop a connection that stays silent for long (a long prompt computed before the
# first token): a comment line this often keeps it open.
PING_SECONDS = 15.0
# No Connection header: uvicorn sets it, and a second one ("keep-alive" beside its
# "close" to an HTTP/1.0 client) contradicted it.
SSE_HEADERS = {"Cache-Control": "no-store",
               # nginx would buffer the stream, holding tokens back.
               "X-Accel-Buffering": "no"}

# JSON may hold these raw inside strings, but line readers built on str.splitlines (httpx's
# aiter_lines among them) end a line at each, cutting an event in two. Escaped, every
# event stays on one line, and its JSON decodes to the same text.
LINE_BREAKERS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


@dataclass(frozen=True, slots=True)
class NamedEvent:
    """An SSE event with an `event:` line (Anthropic's and the Responses API's events)."""

    event: str
    data: str


# What a stream yields: an event's data (one line: JSON, or OpenAI's "[DONE]"), or a named
# event; or a list of them, ready together, which go out in one write.
SSEvent = str | NamedEvent
SSEvents = SSEvent | list[SSEvent]


def frame(event: SSEvents) -> bytes:
    """`event` as the bytes of one SSE event (of each in a list, one after another)."""
    if isinstance(event, list):
        return b"".join(map(frame, event))
    if isinstance(event, NamedEvent):
        return f"event: {event.event}\r\ndata: {_one_line(event.data)}\r\n\r\n".encode()
    return f"data: {_one_line(event)}\r\n\r\n".encode()


def _one_line(data: str) -> str:
    # ASCII text holds no line breaker, and str.isascii is far cheaper than translate.
    return data if data.isascii() else data.translate(LINE_BREAKERS)


def comment_ping() -> bytes:
    return f": ping - {datetime.now(UTC)}\r\n\r\n".encode()


class GenerationEventSource(Response):
    """A `text/event-stream` response of `events` that closes its generation however the
    response ends: finished, failed, or cut short by a client disconnect (even before the
    first event), and pings every `ping_seconds` (a comment, or `ping()`'s event).

    Each item of `events` costs one ASGI send (one socket write) and nothing else: with
    the engine in this process, the event loop's Python per streamed token is taken from
    the decode loop (the GIL), and sse-starlette's per-send cancel scope and backend
    lookups were a fifth of it (bench/results/cpu-amd-epyc-2c/server-hotpath)."""

    media_type = "text/event-stream"
    frame = staticmethod(frame)

    def __init__(
        self, generation: GenerationRun, events: AsyncGenerator[SSEvents, None],
        ping_seconds: float = PING_SECONDS, ping: Callable[[], SSEvent] | None = None,
    ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers(SSE_HEADERS)
        self.generation, self.events = generation, events
        self.ping_seconds = ping_seconds
        self._ping = comment_ping if ping is None else lambda: frame(ping())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # A disconnect cancels this task: Starlette would leave it running, its
        # generation with it, until the next send failed or the stream ended.
        task = asyncio.current_task()
        streaming = True

        def on_disconnect(watcher: asyncio.Future) -> None:
            if streaming and not watcher.cancelled() and watcher.exception() is None:
                task.cancel()

        watcher = asyncio.ensure_future(disconnected(receive))
        watcher.add_done_callback(on_disconnect)
        pinger = None
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            pinger = asyncio.ensure_future(self._pings(send))
            async for event in self.events:
                if body := self.frame(event):  # an empty list: nothing to say yet
                    await send({"type": "http.response.body", "body": body, "more_body": True})
            pinger.cancel()  # no ping after the end, which must be the last message
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not watcher.done() or watcher.cancelled():
                raise  # cancelled from outside (the server stopping): not ours to absorb
            task.uncancel()  # the client left: the response is over, not failed
        finally:
            streaming = False
            watcher.cancel()
            if pinger is not None:
                pinger.cancel()
            await self.events.aclose()
            self.generation.close()

    async def _pings(self, send: Send) -> None:
        while True:
            await asyncio.sleep(self.ping_seconds)
            await send({"type": "http.response.body", "body": self._ping(), "more_body": True})


class JSONLinesSource(GenerationEventSource):
    """A generation's stream as JSON lines (Ollama's `application/x-ndjson`): each item of
    `events` is one object's JSON, or a list of them. No pings: every line must be an
    object, and Ollama's clients read a silent stream until its first token."""

    media_type = "application/x-ndjson"

    @staticmethod
    def frame(event: str | list[str]) -> bytes:
        lines = event if isinstance(event, list) else [event]
        return "".join(f"{_one_line(line)}\n" for line in lines).encode()

    async def _pings(self, send: Send) -> None:
        await asyncio.Event().wait()


async def to_the_end(
    request: Request, generation: GenerationRun, work: Coroutine[Any, Any, T]
) -> T | None:
    """`work` (reading `generation`'s events for a non-streaming response), or None if the
    client disconnects first; the generation is closed either way."""
    try:
        return await unless_disconnected(request, work)
    finally:
        generation.close()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None if the client disconnects first: Starlette does not cancel
    a handler whose client went away, so we watch for it ourselves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    # A future (not a task) is cancelled at once, and done.
    return task.result() if task.done() and not task.cancelled() else None


async def disconnected(receive: Receive) -> None:
    # The body is read already, so the next message can only be the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass
