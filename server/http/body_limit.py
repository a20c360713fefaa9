"""Refusing requests before anything parses them: a head (request line and headers) over
MAX_HEADER_BYTES (400), a body in a transfer coding other than chunked (501) or over the
configured size (413). (The body's JSON is parsed once, by the route:
server/http/json_body.py.)"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.http.errors import APIError, shown

# The largest request head. server/http/uvicorn_protocol.py enforces it only while a head is
# incomplete: one that arrives within a single socket read (up to ~128 KiB on loopback) is
# parsed whole, so it is checked again here, whatever the reads were.
MAX_HEADER_BYTES = 64 * 1024
# A refusal sent before the body is read closes the connection (as nginx does), rather
# than keep it to read and drop all the body the client declared.
CLOSE = {"Connection": "close"}


class BodyLimitMiddleware:
    """Reads the whole body up front (it is small by definition) so that an oversized one
    is refused with a 413 before anything parses it, chunked uploads included; the app
    then reads it from memory and later `receive`s still report a disconnect."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            receive = await self._buffered(scope, receive)
        except APIError as error:
            await error.response(scope)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _buffered(self, scope: Scope, receive: Receive) -> Receive:
        head = len(scope["raw_path"] if scope.get("raw_path") else scope["path"]) + len(
            scope.get("query_string", b"")) + sum(len(k) + len(v) + 4 for k, v in scope["headers"])
        if head > MAX_HEADER_BYTES:
            raise APIError(400, f"the request head is larger than {MAX_HEADER_BYTES} bytes",
                           code="request_header_too_large", headers=CLOSE)
        # llhttp frames a body by its last transfer coding, chunked, and passes on the
        # bytes of any before it undecoded: gzip's were read as JSON (RFC 9112 6.1: 501).
        codings = b",".join(value for name, value in scope["headers"]
                            if name == b"transfer-encoding").decode("latin-1")
        if any(coding.strip().lower() not in ("", "chunked") for coding in codings.split(",")):
            raise APIError(501, f"the transfer coding {shown(codings)} is not supported: send "
                           "the body chunked or with a Content-Length, uncompressed",
                           code="unsupported_transfer_encoding", headers=CLOSE)
        too_large = APIError(
            413, f"request body is larger than {self.limit} bytes", code="request_too_large",
            headers=CLOSE)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            raise too_large
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return receive
        messages: list[Message] = []
        size = 0
        more_body = True
        while more_body:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.limit:
                raise too_large
            more_body = message.get("more_body", False)

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        return replay

