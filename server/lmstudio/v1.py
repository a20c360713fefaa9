"""LM Studio 0.4's REST API, v1 (/api/v1): the model management that maps onto this
server's registry. GET /api/v1/models lists each configured model, loaded or not, with
its loaded instance (one at most: a model here is loaded once); POST
/api/v1/models/load loads one, as its first request would, and waits for it; POST
/api/v1/models/unload unloads it, as Ollama's keep_alive 0 does (once its running
requests are done; a pinned model, or a server's one, is a 409). Chat is
`server.lmstudio.chat`'s; downloads are not served. Errors are v1's `{"error": {"type",
"message", "code", "param"}}`.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.weights_summary import human_number
from server.http.json_body import JSONRoute
from server.http.model_response import model_response
from server.http.openapi import error_responses
from server.lmstudio.models import describe
from server.lmstudio.protocol import (
    Capabilities,
    EmbeddingModel,
    Instance,
    InstanceConfig,
    LanguageModel,
    LoadConfig,
    Loaded,
    LoadRequest,
    Quantization,
    Unloaded,
    UnloadRequest,
    V1ErrorResponse,
    V1ModelList,
)
from server.model_registry import ServedModel
from server.state import server_state

router = APIRouter(prefix="/api/v1", responses=error_responses(V1ErrorResponse),
                   route_class=JSONRoute)


@router.get("/models")
async def list_models(request: Request) -> V1ModelList:
    return V1ModelList(models=[_listed(model) for model in server_state(request).models.models])


def _listed(model: ServedModel) -> LanguageModel | EmbeddingModel:
    described = describe(model)
    instances = [Instance(id=model.id, config=InstanceConfig(
        context_length=model.context_length))] if described.loaded else []
    common = {"publisher": described.publisher, "key": model.id, "display_name": model.id,
              "quantization": Quantization(name=described.quantization or None,
                                           bits_per_weight=described.bits_per_weight),
              "size_bytes": described.size_bytes,
              "params_string": None if described.parameters is None
              else human_number(described.parameters),
              "loaded_instances": instances,
              "max_context_length": described.max_context_length,
              "format": described.format}
    if described.type == "embeddings":
        return EmbeddingModel(**common)
    return LanguageModel(**common, architecture=described.arch or None,
                         capabilities=Capabilities(vision=described.vision,
                                                   trained_for_tool_use=described.tool_use))


@router.post("/models/load")
async def load(body: LoadRequest, request: Request) -> Response:
    models, started = server_state(request).models, time.monotonic()
    async with models.use(body.model) as lease:
        model = lease.model
    config = LoadConfig(context_length=model.context_length) if body.echo_load_config else None
    return model_response(Loaded(
        type="embedding" if describe(model).type == "embeddings" else "llm",
        instance_id=model.id, load_time_seconds=round(time.monotonic() - started, 3),
        load_config=config), exclude_none=True)


@router.post("/models/unload")
async def unload(body: UnloadRequest, request: Request) -> Unloaded:
    models = server_state(request).models
    await models.unload_once_idle(models.lookup(body.instance_id))
    return Unloaded(instance_id=body.instance_id)
