"""Bearer API key for the /v1 routes, when one is configured.

The probes (/health, /metrics) stay open so load balancers and Prometheus need no secret.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from server.errors import APIError
from server.state import server_state


async def require_api_key(request: Request) -> None:
    key = server_state(request).settings.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # Constant time, so response timing does not reveal how much of a guess was right.
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        token.strip().encode(), key.get_secret_value().encode()
    ):
        raise APIError(
            401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
        )
