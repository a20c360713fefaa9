"""The HTTP/1.1 protocol uvicorn serves with: its httptools (llhttp) one, plus a limit on
the request head, and streams to HTTP/1.0 clients without chunked framing.

With the engine in this process, the event loop's Python per streamed token is taken
from the decode loop (the GIL). h11's pure-Python state machine and chunk writer were
13% of the loop's CPU per streamed token; llhttp parses in C and uvicorn's httptools
protocol frames a chunk in a few lines (bench/results/cpu-amd-epyc-2c/server-token-cpu).

h11 refused a head over its buffer limit; llhttp keeps a header's name and value itself
until they end, so the bytes of an unfinished head are counted here instead.
"""

from __future__ import annotations

from uvicorn._types import ASGISendEvent
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from server.http.body_limit import MAX_HEADER_BYTES


class BoundedHeadProtocol(HttpToolsProtocol):
    """Refuses (400, connection closed) a request whose head goes on past MAX_HEADER_BYTES.

    Counted in whole socket reads that leave a head unfinished, as h11 did: a head that
    ends within the read that brought it is measured by `BodyLimitMiddleware` instead."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes: int | None = 0  # None: the head is complete, the body follows

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
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

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        super().on_headers_complete()
        if self.scope.get("http_version") == "1.0" and self.cycle.scope is self.scope:
            _close_delimited(self.cycle)


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
