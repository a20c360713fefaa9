"""The outermost layer of every HTTP request: request id, drain gate, body-size limit,
last-resort 500s, the request counter and the one access-log line.

Pure ASGI rather than Starlette's BaseHTTPMiddleware, so streamed responses pass through
untouched and the log line is written when the stream really ends.
"""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError
from server.state import ServerState

access_log = logging.getLogger("radix_mlx.access")
log = logging.getLogger("radix_mlx.server")

# Paths worth their own metric label; anything else is "other" (bounded cardinality).
ENDPOINTS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics",
})
REQUEST_ID = re.compile(r"[\w.:-]{1,64}", re.ASCII)
# Load balancers keep probing while we drain; everything else is refused.
PROBES = frozenset({"/health", "/metrics"})


class RequestMiddleware:
    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started_at = time.perf_counter()
        headers = dict(scope["headers"])
        # A caller's id is kept for tracing if it is safe to print in a log line.
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")
        if not REQUEST_ID.fullmatch(request_id):
            request_id = uuid.uuid4().hex
        scope.setdefault("state", {}).update(request_id=request_id, started_at=started_at)
        status = 500
        response_started = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                status, response_started = message["status"], True
                message["headers"] = [*message.get("headers", []),
                                      (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        drain = self.state.drain
        drain.inflight += 1
        try:
            if drain.draining and scope["path"] not in PROBES:
                raise APIError(503, "the server is shutting down", code="shutting_down")
            receive = await self._limit_body(scope, headers, receive)
            await self.app(scope, receive, send_with_id)
        except APIError as error:
            await error.response()(scope, receive, send_with_id)
        except Exception:
            log.exception("request %s failed", request_id)
            if not response_started:
                await APIError(
                    500, f"internal server error (request id {request_id})",
                    code="internal_error",
                ).response()(scope, receive, send_with_id)
        finally:
            drain.inflight -= 1
            path = scope["path"]
            endpoint = path if path in ENDPOINTS else "other"
            if path.startswith("/v1/models/"):
                endpoint = "/v1/models/{model}"
            self.state.metrics.count_request(endpoint, status)
            self._log(scope, request_id, status, started_at)

    async def _limit_body(
        self, scope: Scope, headers: dict[bytes, bytes], receive: Receive
    ) -> Receive:
        """Read the whole body up front (it is small by definition) so that an oversized
        one is refused before anything parses it, chunked uploads included; the app then
        reads it from memory and later `receive`s still report a disconnect."""
        limit = self.state.settings.max_body_bytes
        too_large = APIError(
            413, f"request body is larger than {limit} bytes", code="request_too_large"
        )
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
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
            if size > limit:
                raise too_large
            more_body = message.get("more_body", False)

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        return replay

    def _log(self, scope: Scope, request_id: str, status: int, started_at: float) -> None:
        end = time.perf_counter()
        stats = scope.get("state", {}).get("stats")
        fields = "prompt=- cached=- completion=- ttft_ms=- tok/s=-"
        if stats is not None:
            ttft = tok_s = "-"
            if stats.first_token_at is not None:
                ttft = f"{(stats.first_token_at - started_at) * 1000:.1f}"
                decode = (stats.last_token_at or end) - stats.first_token_at
                if stats.completion_tokens > 1 and decode > 0:
                    tok_s = f"{(stats.completion_tokens - 1) / decode:.1f}"
            fields = (f"prompt={stats.prompt_tokens} cached={stats.cached_tokens} "
                      f"completion={stats.completion_tokens} ttft_ms={ttft} tok/s={tok_s}")
        access_log.info(
            "%s %s %s %d %s duration_ms=%.1f", request_id, scope["method"], scope["path"],
            status, fields, (end - started_at) * 1000,
        )
