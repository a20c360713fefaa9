"""HEAD answered on every path that answers GET, as GET's status and headers without its
body (RFC 9110 9.3.2). FastAPI's routes take only the methods they name, so `curl -I`
of /v1/models was a 405 where Starlette's own routes, and every peer server, answer it.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HeadAsGet:
    """Runs a HEAD request as GET and drops the body it answers. The scope the server
    holds still says HEAD, so uvicorn writes no body either, and the access log names
    the method the client sent."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def without_body(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, without_body)
