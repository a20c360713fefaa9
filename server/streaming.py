"""Ending a generation's HTTP response cleanly, for every front end: an SSE response
that closes its generation however it ends, and a non-streaming wait that notices a
client that went away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from fastapi import Request
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.types import Receive, Scope, Send

from server.pipeline import Generation

T = TypeVar("T")

# nginx's "client closed request": logged for a non-streaming request whose client left.
CLIENT_CLOSED = 499


# JSON may hold these raw inside strings, but line readers built on str.splitlines (httpx's
# aiter_lines among them) end a line at each, cutting an event in two. Escaped, every
# event stays on one line, and its JSON decodes to the same text.
LINE_BREAKERS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


class GenerationEventSource(EventSourceResponse):
    """An SSE response that closes its generation however the response ends: finished,
    failed, or cut short by a client disconnect (even before the first event)."""

    def __init__(
        self, generation: Generation, events: AsyncIterator[str | ServerSentEvent],
        **options: Any,
    ) -> None:
        super().__init__(_one_line_each(events), **options)
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()


async def _one_line_each(
    events: AsyncIterator[str | ServerSentEvent],
) -> AsyncIterator[str | ServerSentEvent]:
    async for event in events:
        if isinstance(event, ServerSentEvent):
            event.data = _one_line(event.data)
            yield event
        else:
            yield _one_line(event)


def _one_line(data: object) -> object:
    # ASCII text holds no line breaker, and str.isascii is far cheaper than translate.
    if isinstance(data, str) and not data.isascii():
        return data.translate(LINE_BREAKERS)
    return data


async def to_the_end(
    request: Request, generation: Generation, work: Coroutine[Any, Any, T]
) -> T | None:
    """`work` (reading `generation`'s events for a non-streaming response), or None if the
    client disconnects first; the generation is closed either way."""
    try:
        return await unless_disconnected(request, work)
    finally:
        generation.close()


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """`work`'s result, or None if the client disconnects first: Starlette does not cancel
    a handler whose client went away, so we watch for it ourselves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() else None


async def _disconnect(request: Request) -> None:
    # The body is read already, so the next message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
