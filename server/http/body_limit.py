"""Refusing requests before anything parses them: a head (request line and headers) over
MAX_HEADER_BYTES (400) or a body over the configured size (413). (The body's JSON is
parsed once, by the route: server/http/json_body.py.)"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.http.errors import APIError

# The largest request head. server/http/uvicorn_protocol.py enforces it only while a head is
# incomplete: one that arrives within a single socket read (up to ~128 KiB on loopback) is
# parsed whole, so it is checked again here, whatever the reads were.
MAX_HEADER_BYTES = 64 * 1024


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
                           code="request_header_too_large")
        # Sent before the rest of the body is read: the connection is closed (as nginx
        # does) rather than kept to read and drop all the body the client declared.
        too_large = APIError(
            413, f"request body is larger than {self.limit} bytes", code="request_too_large",
            headers={"Connection": "close"})
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

