"""What load balancers, supervisors and clients probe: /, /health and /metrics."""

from __future__ import annotations

import asyncio
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from server.http.json_body import JSONRoute
from server.metrics import CONTENT_TYPE
from server.model_registry import ModelState
from server.schema import ResponseModel
from server.state import server_state


class ModelHealth(ResponseModel):
    id: str
    state: Literal["unloaded", "loading", "loaded"]
    pinned: bool
    error: str | None = None


class Health(ResponseModel):
    """/health: 200 when ready, the same body with 503 otherwise. With several models the
    server is ready once its pinned models are loaded; `models` tells each one's state."""

    status: Literal["loading", "warming_up", "ready", "failed", "draining"]
    model: str
    error: str | None = None
    models: list[ModelHealth]


probes = APIRouter(route_class=JSONRoute)


@probes.get("/", response_class=PlainTextResponse)
async def root() -> str:
    """Clients probe the base URL before they start (Claude Code sends HEAD /). Clients
    built for Ollama compare the body, whole, with Ollama's own, to tell that its API
    (/api, served here too) is there."""
    return "Ollama is running"


# Load balancers probe with HEAD (server/http/head.py): the status is the answer.
@probes.get("/health", responses={200: {"model": Health}, 503: {"model": Health}})
async def health(request: Request) -> JSONResponse:
    state = server_state(request)
    models = state.models
    first = models.default
    if models.on_demand:
        down = [model for model in models.models
                if model.spec.pinned and model.state is not ModelState.LOADED]
        # A pinned model that is not loading failed its load: "loading" would say it
        # comes by itself.
        status = ("loading" if any(model.loading is not None for model in down)
                  else "failed" if down else "ready")
    else:
        status = first.engine.state.value
    body = Health(
        status="draining" if state.drain.draining else status, model=first.id,
        error=first.error if status == "failed" else None,
        models=[ModelHealth(id=model.id, state=model.state.value, pinned=model.spec.pinned,
                            error=model.error) for model in models.models],
    ).model_dump(exclude_none=True)
    return JSONResponse(body, 200 if body["status"] == "ready" else 503)


@probes.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    # Off the loop: each engine process's stats are a round trip, and a hung one's waits
    # out its timeout (every stream of every model stalled for it).
    body = await asyncio.to_thread(server_state(request).metrics.render)
    return Response(body, media_type=CONTENT_TYPE)
