"""The outermost layer of every HTTP request: its id, the drain gate, last-resort 500s,
the request counter and the access-log line.

Pure ASGI rather than Starlette's BaseHTTPMiddleware, so streamed responses pass through
untouched and the log line is written when the stream really ends.
"""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.http.access_log import log_request
from server.http.drain import shutting_down
from server.http.errors import APIError
from server.http.streaming import CLIENT_CLOSED
from server.state import ServerState

log = logging.getLogger("radix_mlx.server")

# Paths worth their own metric label; anything else is "other" (bounded cardinality).
ENDPOINTS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
    "/v1/messages/count_tokens", "/v1/responses/input_tokens", "/v1/models", "/health",
    "/metrics",
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
        # A caller's id is kept for tracing if it is safe to print in a log line.
        request_id = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        if not REQUEST_ID.fullmatch(request_id):
            request_id = uuid.uuid4().hex
        scope.setdefault("state", {}).update(request_id=request_id, started_at=started_at)
        status = 500
        response_started = response_ended = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, response_started, response_ended
            if message["type"] == "http.response.start":
                status, response_started = message["status"], True
                # OpenAI's SDKs read the first name, Anthropic's the second.
                value = request_id.encode("latin-1")
                message["headers"] = [*message.get("headers", []),
                                      (b"x-request-id", value), (b"request-id", value)]
            elif not message.get("more_body", False):
                response_ended = True
            await send(message)

        drain = self.state.drain
        drain.inflight += 1
        try:
            if drain.draining and scope["path"] not in PROBES:
                raise shutting_down()
            await self.app(scope, receive, send_with_id)
        except APIError as error:
            await error.response(scope)(scope, receive, send_with_id)
        except Exception:
            log.exception("request %s failed", request_id)
            if not response_started:
                await APIError(
                    500, f"internal server error (request id {request_id})",
                    code="internal_error",
                ).response(scope)(scope, receive, send_with_id)
        else:
            if response_started and not response_ended:
                # A stream whose client left before its end: logged and counted as the
                # request without streaming is, not as the 200 its head said.
                status = CLIENT_CLOSED
        finally:
            drain.inflight -= 1
            self.state.metrics.count_request(_endpoint(scope["path"]), status)
            log_request(request_id, scope["method"], scope["path"], status, started_at,
                        scope["state"].get("stats"))


def _endpoint(path: str) -> str:
    if path in ENDPOINTS:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    if path.startswith("/v1/responses/"):
        return "/v1/responses/{response_id}"
    return "other"
