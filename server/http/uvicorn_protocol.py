"""The HTTP/1.1 protocol uvicorn serves with: its httptools (llhttp) one, plus limits on
the request head and on how long a response waits for its client to read, and streams to
HTTP/1.0 clients without chunked framing.

With the engine in this process, the event loop's Python per streamed token is taken
from the decode loop (the GIL). h11's pure-Python state machine and chunk writer were
13% of the loop's CPU per streamed token; llhttp parses in C and uvicorn's httptools
protocol frames a chunk in a few lines (bench/results/cpu-amd-epyc-2c/server-token-cpu).

h11 refused a head over its buffer limit; llhttp keeps a header's name and value itself
until they end, so the bytes of an unfinished head are counted here instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
from collections.abc import Callable

import httptools
from uvicorn._types import ASGI3Application, ASGISendEvent
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from server.http.body_limit import MAX_HEADER_BYTES

log = logging.getLogger("radix_mlx.server")


class BoundedProtocol(HttpToolsProtocol):
    """Refuses (400, connection closed) a request whose head goes on past MAX_HEADER_BYTES,
    and closes (408) a connection whose head is not complete `head_timeout` seconds after
    it opened or the head began, or whose body sends nothing for `head_timeout` seconds:
    clients that trickle a head byte by byte (slowloris), or send a head and part of a
    body, held their connections, and a file descriptor each, for as long as they liked,
    until the server could accept no one. A body is timed per read, as nginx's
    client_body_timeout, so that a large one on a slow link still arrives.

    Counted in whole socket reads that leave a head unfinished, as h11 did: a head that
    ends within the read that brought it is measured by `BodyLimitMiddleware` instead.

    Drops a connection whose client has taken none of its response for `write_timeout`
    seconds (nginx's send_timeout). uvicorn's `send` waits while the transport's buffer is
    full, but the engine goes on decoding the request to its max_tokens and its events
    pile up unread in the request's stream (engine/streams.py): 30 streams whose clients
    never read held 107 MiB. The connection is aborted, not closed, because a close waits
    for the buffer to flush; the response then sees the disconnect and cancels its
    generation (server/http/streaming.py).

    Tells the request being answered that its client left even when pipelined requests
    queue behind it: uvicorn tells only the last one parsed, so the first decoded on to its
    max_tokens, holding its row, for a connection already gone.

    Declines an offer to upgrade the connection (`Upgrade: h2c`, which curl --http2 and
    Java's HttpClient send on http:// URLs) and answers the request over HTTP/1.1, as RFC
    9110 lets a server: llhttp stops at the end of such a head, and uvicorn served the
    request with an empty body."""

    def __init__(self, *args, head_timeout: float, write_timeout: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes: int | None = 0  # None: the head is complete, the body follows
        self._answering: RequestResponseCycle | None = None
        self._declined_upgrade_body = 0  # body bytes still owed after a declined upgrade
        self._head_timeout = head_timeout
        # Runs while the client owes a head or more of a body: they never overlap.
        self._read_timer: asyncio.TimerHandle | None = None
        self._write_timeout = write_timeout
        self._write_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        _hold_little_unsent(transport)
        self._await_client(self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._client_sent()
        self._written()
        answering = self._answering
        if answering is not None and answering is not self.cycle and not answering.response_complete:
            answering.disconnected = True
            answering.message_event.set()
        super().connection_lost(exc)

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
        self._answering = cycle
        super()._start_asgi_task(cycle, app)

    def pause_writing(self) -> None:
        super().pause_writing()
        self._await_reader(self.transport.get_write_buffer_size())

    def resume_writing(self) -> None:
        self._written()
        super().resume_writing()

    def data_received(self, data: bytes) -> None:
        if self._declined_upgrade_body:
            self._take_declined_upgrade_body(data)
            return
        # uvicorn's own, but for an upgrade offered to HTTP/2, which it read as a bodiless request.
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            message = "Invalid HTTP request received."
            self.logger.warning(message)
            self.send_400_response(message)
            return
        except httptools.HttpParserUpgrade as upgrade:
            if self._should_upgrade():  # a websocket: uvicorn's, which the app refuses
                self.handle_websocket_upgrade()
            else:
                self._decline_upgrade(data[upgrade.args[0]:])
            return
        if self._head_bytes is None or self.transport.is_closing():
            return
        self._head_bytes += len(data)
        if self._head_bytes > MAX_HEADER_BYTES:
            message = f"The request head is larger than {MAX_HEADER_BYTES} bytes."
            self.logger.warning(message)
            self.send_400_response(message)

    def on_message_begin(self) -> None:
        self._head_bytes = 0
        super().on_message_begin()
        self._await_client(self._head_timed_out)

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        self._await_client(self._body_timed_out)
        super().on_headers_complete()
        if self.scope.get("http_version") == "1.0" and self.cycle.scope is self.scope:
            _close_delimited(self.cycle)

    def on_body(self, body: bytes) -> None:
        self._await_client(self._body_timed_out)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._client_sent()
        super().on_message_complete()

    def _decline_upgrade(self, rest: bytes) -> None:
        """Serve the request whose head offered an upgrade as a plain one: llhttp ended it
        at its head, so its body (`rest`, then what follows) is handed over here, and the
        connection closes after the answer, since its parser stays paused."""
        headers = dict(self.headers)
        if b"transfer-encoding" in headers:
            self.send_400_response("An upgrade offer with a chunked body is not served.")
            return
        self.cycle.keep_alive = False
        self._declined_upgrade_body = int(headers.get(b"content-length", b"0"))
        if self._declined_upgrade_body:
            self.cycle.more_body = True  # llhttp reported the message complete at its head
            self._await_client(self._body_timed_out)
            self._take_declined_upgrade_body(rest)

    def _take_declined_upgrade_body(self, data: bytes) -> None:
        body = data[:self._declined_upgrade_body]
        self._declined_upgrade_body -= len(body)
        if body:
            self.on_body(body)
        if not self._declined_upgrade_body:
            self.on_message_complete()

    def _await_client(self, timed_out: Callable[[], None]) -> None:
        self._client_sent()
        self._read_timer = self.loop.call_later(self._head_timeout, timed_out)

    def _client_sent(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _head_timed_out(self) -> None:
        self._read_timer = None
        # A pipelined head behind a response still being sent is left to that response.
        if self.transport.is_closing() or (self.cycle and not self.cycle.response_complete):
            return
        self.transport.write(REQUEST_TIMEOUT)
        self.transport.close()

    def _body_timed_out(self) -> None:
        self._read_timer = None
        if self.flow.read_paused:  # the app has not taken what came: the wait is ours
            self._await_client(self._body_timed_out)
            return
        # A response begun before its body was read (one that never reads it) goes on.
        if self.transport.is_closing() or (self.cycle.response_started
                                           and not self.cycle.response_complete):
            return
        if not self.cycle.response_started:
            self.transport.write(REQUEST_TIMEOUT)
        self.transport.close()

    def _await_reader(self, waiting: int) -> None:
        self._written()
        self._write_timer = self.loop.call_later(
            self._write_timeout, self._write_timed_out, waiting)

    def _written(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_timed_out(self, waiting: int) -> None:
        self._write_timer = None
        left = self.transport.get_write_buffer_size()
        if left < waiting:  # the client reads, if slowly
            self._await_reader(left)
            return
        request_id = (self.cycle.scope.get("state", {}).get("request_id", "-")
                      if self.cycle else "-")
        log.warning("request %s: its client took no bytes of the response for %g s "
                    "(write_timeout): connection closed", request_id, self._write_timeout)
        self.transport.abort()


def _hold_little_unsent(transport: asyncio.Transport) -> None:
    """Have the kernel take no more of a response than NOT_SENT_BYTES past what the client
    has room for. Otherwise its send buffer grows to megabytes (Linux: 4 MiB) under a
    client that reads nothing, and at a stream's few KB a second the transport's own buffer,
    which `write_timeout` watches, stays empty for many minutes while the request decodes
    on. In-flight bytes still go by TCP's windows, so a fast client gets its bytes as
    fast."""
    sock = transport.get_extra_info("socket")
    if sock is None or NOT_SENT_LOWAT is None or sock.family not in (
            socket.AF_INET, socket.AF_INET6):
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, NOT_SENT_LOWAT, NOT_SENT_BYTES)


# TCP_NOTSENT_LOWAT: Linux's 25, Darwin's 0x201 (Python names only Linux's).
NOT_SENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 0x201 if sys.platform == "darwin" else None)
NOT_SENT_BYTES = 16 * 1024

REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\n"
                   b"connection: close\r\n\r\n")

# More than any body sent: what a body of unknown length may hold (`_close_delimited`).
UNBOUNDED = 1 << 62


def _close_delimited(cycle: RequestResponseCycle) -> None:
    """uvicorn frames a body of unknown length (a stream) in chunks, which HTTP/1.0 lacks:
    a client or proxy speaking it (nginx does upstream unless told otherwise) reads the
    chunk sizes as body. For HTTP/1.0 such a body is sent as it is and ends as the
    connection closes (an HTTP/1.0 connection is never kept alive). uvicorn's cycle counts
    the bytes it writes against a length, so the length is made unbounded, then set to
    what the last part brings."""
    send, unbounded = cycle.send, False

    async def close_delimited(message: ASGISendEvent) -> None:
        nonlocal unbounded
        if message["type"] == "http.response.start" and not any(
                name.lower() in (b"content-length", b"transfer-encoding")
                for name, _ in message.get("headers", ())):
            unbounded = True
            cycle.chunked_encoding = False
            cycle.expected_content_length = UNBOUNDED
        elif unbounded and message["type"] == "http.response.body" and not message.get(
                "more_body", False):
            cycle.expected_content_length = len(message.get("body", b""))
        await send(message)

    cycle.send = close_delimited
