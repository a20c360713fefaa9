"""Answering a request whose model must load first.

A non-streaming request simply waits for the load. A streaming one gets its response
(200, `text/event-stream`) at once and keep-alive pings while it waits, so that no proxy
or client gives up on a silent connection; the generation's own stream then follows on
the same response. A load that fails after that point can no longer change the status
line, so its error travels as the API's own error event, as any error mid-stream does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from server.http.errors import APIError
from server.http.streaming import (
    PING_SECONDS,
    SSE_HEADERS,
    SSEvent,
    SSEvents,
    comment_ping,
    disconnected,
    frame,
)
from server.model_registry import Lease, ModelRegistry

Respond = Callable[[Lease], Awaitable[Response]]


async def respond_with_model(
    models: ModelRegistry, name: str | None, streaming: bool, respond: Respond,
    stream_error: Callable[[APIError], SSEvents], ping: Callable[[], SSEvent] | None = None,
    opening: list[SSEvent] | None = None,
) -> Response:
    """`respond(lease)` once `name`'s model is loaded. `respond` hands the lease to the
    generation it starts (released when that ends); if it raises, the lease is released
    here. `opening`: events a stream that waits for the load sends at once (LM Studio's
    chat.start and model_load.start), which `respond`'s stream then leaves out."""
    if not streaming or models.is_ready(name):
        return await _responded(await models.acquire(name), respond)
    models.lookup(name)  # an unknown model is still a plain 404
    return LoadingEventSource(models, name, respond, stream_error, ping, opening)


async def _responded(lease: Lease, respond: Respond) -> Response:
    try:
        return await respond(lease)
    except BaseException:
        lease.release()
        raise


class LoadingEventSource(Response):
    """An event stream that pings until the model is loaded, then carries the stream of
    the response `respond` makes (without its status line, which went out first)."""

    media_type = "text/event-stream"

    def __init__(
        self, models: ModelRegistry, name: str | None, respond: Respond,
        stream_error: Callable[[APIError], SSEvents], ping: Callable[[], SSEvent] | None,
        opening: list[SSEvent] | None = None,
    ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers(SSE_HEADERS)
        self._models, self._name, self._respond = models, name, respond
        self._stream_error = stream_error
        self._ping = comment_ping if ping is None else lambda: frame(ping())
        self._opening = frame(opening) if opening else b""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        if self._opening:
            await send({"type": "http.response.body", "body": self._opening,
                        "more_body": True})
        pinger = asyncio.ensure_future(self._pings(send))
        waiting = asyncio.ensure_future(self._models.acquire(self._name))
        watcher = asyncio.ensure_future(disconnected(receive))
        try:
            await asyncio.wait({waiting, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            pinger.cancel()
            watcher.cancel()
        if not waiting.done():  # the client left; the load goes on for the next one
            waiting.cancel()
            return
        try:
            response = await _responded(waiting.result(), self._respond)
        except APIError as error:
            await send({"type": "http.response.body", "body": frame(self._stream_error(error)),
                        "more_body": False})
            return

        async def body_only(message: Message) -> None:
            if message["type"] != "http.response.start":
                await send(message)

        await response(scope, receive, body_only)

    async def _pings(self, send: Send) -> None:
        while True:
            await asyncio.sleep(PING_SECONDS)
            await send({"type": "http.response.body", "body": self._ping(), "more_body": True})
