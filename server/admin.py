"""Operators' endpoints, behind the API key like every route but /health: GET
/admin/cache reports both tiers of a model's prefix cache, DELETE /admin/cache empties
them (`?model=`: which model; the first by default; a model of several that is not
loaded is emptied as its next load ends); POST /admin/models/{id}/load and /unload load
and unload a model of several."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from engine.api import EngineClient, EngineNotReady, EngineStats
from server.http.errors import APIError
from server.http.json_body import JSONRoute
from server.model_registry import RETRY_LATER, ModelRegistry, ServedModel
from server.state import server_state

admin = APIRouter(prefix="/admin", route_class=JSONRoute)


# One route, so a 405 lists both methods in `Allow`; FastAPI would give its two methods one
# OpenAPI operation id, so it stays out of the schema (an operator's endpoint, not the API's).
@admin.api_route("/cache", methods=["GET", "DELETE"], include_in_schema=False)
async def cache(request: Request, model: str | None = None) -> dict[str, Any]:
    """GET: both tiers' state. DELETE: drop every cached prefix no request is using, from
    memory and from disk."""
    if request.method == "GET":
        return await _tiers(_ready_engine(request, model))
    return await clear_cache(request, model)


async def clear_cache(request: Request, model: str | None = None) -> dict[str, Any]:
    """Drop every cached prefix no request is using, from both tiers (a router's
    /flush_cache does it for every model, worker_info.py); what is left and the memory
    freed."""
    models = server_state(request).models
    served = models.lookup(model)
    return {"cleared": True, **await cleared(models, served)}


async def cleared(models: ModelRegistry, served: ServedModel) -> dict[str, Any]:
    """Clear `served`'s cache: the memory freed and both tiers now, or, for a model that
    is not loaded, that its next load clears it."""
    engine = served.engine
    freed = await models.clear_cache(served)
    if freed is None:
        return {"memory_bytes_freed": 0, "cleared_on_load": True}
    try:
        return {"memory_bytes_freed": freed, **await _tiers(engine)}
    except APIError:  # unloaded, or not answering, since: the clear itself is done
        return {"memory_bytes_freed": freed}


@admin.post("/models/{model:path}/load", include_in_schema=False)
async def load_model(model: str, request: Request) -> dict[str, Any]:
    """Load the model now (a request would load it too); waits for the load."""
    models, served = _one_of_several(request, model)
    await models.load(served)
    return {"id": served.id, "state": served.state.value}


@admin.post("/models/{model:path}/unload", include_in_schema=False)
async def unload_model(model: str, request: Request) -> dict[str, Any]:
    """Unload the model (its disk tier keeps its cache); 409 while requests use it."""
    models, served = _one_of_several(request, model)
    if served.spec.pinned:
        raise APIError(409, f"the model {served.id} is pinned", code="model_pinned")
    await models.unload(served)
    return {"id": served.id, "state": served.state.value}


def _one_of_several(request: Request, model: str) -> tuple[ModelRegistry, ServedModel]:
    models = server_state(request).models
    served = models.lookup(model)
    if not models.on_demand:
        raise APIError(400, "this server serves one model, loaded at start",
                       code="invalid_request")
    return models, served


def _ready_engine(request: Request, model: str | None) -> EngineClient:
    return server_state(request).models.lookup(model).check_ready()


async def engine_stats(engine: EngineClient) -> EngineStats:
    """The engine's stats, read off the loop: an engine process's are a round trip, a hung
    one's as long as its timeout. A 503 when it does not answer, or has stopped."""
    try:
        return await asyncio.to_thread(engine.stats)
    except TimeoutError:
        raise APIError(503, "the model's engine does not answer", code="engine_unresponsive",
                       headers=RETRY_LATER) from None
    except EngineNotReady:
        raise APIError(503, "the model's engine stopped", code="model_not_ready",
                       headers=RETRY_LATER) from None


async def _tiers(engine: EngineClient) -> dict[str, Any]:
    stats = await engine_stats(engine)
    tree, disk = stats.tree, stats.disk
    memory = {
        "bytes": tree.total_bytes, "evictable_bytes": tree.evictable_bytes,
        "pinned_bytes": tree.pinned_bytes, "tokens": tree.total_tokens,
        "capacity_bytes": tree.capacity_bytes, "nodes": tree.nodes,
        "hits": tree.hits, "hit_tokens": tree.hit_tokens, "misses": tree.misses,
        "evictions": tree.evictions,
    }
    on_disk: dict[str, Any] = {"enabled": engine.disk is not None}
    if engine.disk is not None:
        on_disk |= {
            "directory": str(engine.disk.directory),
            "bytes": tree.disk_bytes, "evictable_bytes": tree.disk_evictable_bytes,
            "pinned_bytes": tree.disk_pinned_bytes, "tokens": tree.disk_tokens,
            "capacity_bytes": tree.disk_capacity_bytes, "nodes": tree.disk_nodes,
            "hits": tree.disk_hits, "hit_tokens": tree.disk_hit_tokens,
            "evictions": tree.disk_evictions, "demotions": tree.disk_demotions,
            "writes": disk.writes, "write_bytes": disk.write_bytes,
            "writes_dropped": disk.writes_dropped, "write_errors": disk.write_errors,
            "queued_bytes": disk.queued_bytes, "loads": disk.loads,
            "load_bytes": disk.load_bytes,
            "load_bytes_per_second": disk.load_bytes / disk.load_seconds
            if disk.load_seconds else None,
            "bad_files": disk.bad_files, "restored_nodes": disk.restored_nodes,
            "rebuilding": bool(disk.rebuilding),
        }
    return {"memory": memory, "disk": on_disk}
