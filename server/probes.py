"""What load balancers, supervisors and clients probe: /, /health and /metrics."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from engine.api import Lifecycle
from server.http.json_body import JSONRoute
from server.metrics import CONTENT_TYPE
from server.schema import ResponseModel
from server.state import server_state


class Health(ResponseModel):
    """/health: 200 when ready, the same body with 503 otherwise."""

    status: Literal["loading", "warming_up", "ready", "failed", "draining"]
    model: str
    error: str | None = None


probes = APIRouter(route_class=JSONRoute)


@probes.get("/", response_class=PlainTextResponse)
@probes.head("/", response_class=PlainTextResponse)
async def root() -> str:
    """Clients probe the base URL before they start (Claude Code sends HEAD /)."""
    return "radix-mlx is running\n"


@probes.get("/health", responses={200: {"model": Health}, 503: {"model": Health}})
async def health(request: Request) -> JSONResponse:
    state = server_state(request)
    engine = state.engine
    body: dict[str, object] = {"status": engine.state.value, "model": engine.model_id}
    if engine.state is Lifecycle.FAILED:
        body["error"] = engine.error
    if state.drain.draining:
        body["status"] = "draining"
    ready = engine.state is Lifecycle.READY and not state.drain.draining
    return JSONResponse(body, 200 if ready else 503)


@probes.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE)
