"""API key for every route but / and /health, when one is configured: `Authorization: Bearer
KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's).

A pure ASGI layer rather than a route dependency, so a request without the key is
refused before its body is parsed: an unauthenticated client learns nothing about its
input. It sits inside CORS, so browsers can read the 401, and lets CORS preflights
(which never carry credentials) through. Only / (which says a server is there, as clients
probe it) and /health stay open, so load balancers and service managers need no secret; /metrics tells how busy the server is and what it
caches, so Prometheus scrapes it with the key (`authorization` in its scrape config).
"""

from __future__ import annotations

import hmac

from pydantic import SecretStr
from starlette.types import ASGIApp, Receive, Scope, Send

from server.http.body_limit import CLOSE
from server.http.errors import APIError

# "/" says only that a server is there; clients probe it before they authenticate. Only
# probes are open: a POST to "/" is TEI's embed (server/tei_embed.py), an API call.
OPEN_PATHS = frozenset({"/", "/health"})
PROBE_METHODS = frozenset({"GET", "HEAD"})


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, key: SecretStr) -> None:
        self.app = app
        self._key = key.get_secret_value().encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["method"] != "OPTIONS"
                and not (scope["path"] in OPEN_PATHS and scope["method"] in PROBE_METHODS)
                and not self._authorized(scope)):
            await APIError(
                401, "missing or invalid API key (send 'Authorization: Bearer <key>' or "
                "'x-api-key: <key>')",
                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer", **CLOSE},
            ).response(scope)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        """Either header with the key will do: a client (or a proxy in front of it) may send
        one of them stale beside the other."""
        headers = dict(scope["headers"])
        scheme, _, bearer = headers.get(b"authorization", b"").partition(b" ")
        tokens = [headers.get(b"x-api-key", b"")]
        if scheme.lower() == b"bearer":
            tokens.append(bearer)
        # Constant time, so response timing does not reveal how much of a guess was right;
        # both compared, so it does not reveal which header held it either.
        matches = [hmac.compare_digest(token.strip(), self._key) for token in tokens]
        return any(matches)
