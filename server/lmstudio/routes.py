"""LM Studio's own REST API, v0 (/api/v0): what tools written for LM Studio's server call
beside its OpenAI-compatible /v1, answered by the same engines and cache.

GET /api/v0/models lists every configured model under each of its names, loaded or not,
as LM Studio describes its models: type, publisher, architecture, format
(`compatibility_type`), quantization, state and context window. Errors are OpenAI's
error object, as LM Studio's are.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request

from server.http.json_body import JSONRoute
from server.http.openapi import error_responses
from server.lmstudio.protocol import ModelEntry, ModelList
from server.model_facts import ModelFacts, capabilities, model_config, model_facts
from server.model_registry import ModelState, ServedModel
from server.openai.protocol import ErrorResponse
from server.state import server_state

router = APIRouter(prefix="/api/v0", responses=error_responses(ErrorResponse),
                   route_class=JSONRoute)


@router.get("/models")
async def list_models(request: Request) -> ModelList:
    state = server_state(request)
    return ModelList(data=[_entry(model, name) for model in state.models.models
                           for name in state.models.names_of(model)])


@router.get("/models/{model:path}")
async def get_model(model: str, request: Request) -> ModelEntry:
    models = server_state(request).models
    served = models.lookup(model)
    return _entry(served, models.name_for(served, model))


def _entry(model: ServedModel, name: str) -> ModelEntry:
    facts, can = model_facts(model), capabilities(model)
    kind = ("embeddings" if "completion" not in can else "vlm" if "vision" in can
            else "llm")
    return ModelEntry(
        id=name, type=kind, publisher=_publisher(facts.source), arch=facts.family,
        compatibility_type=_format(facts), quantization=_quantization(facts),
        state="loaded" if model.state is ModelState.LOADED else "not-loaded",
        max_context_length=_context_length(model),
        capabilities=["tool_use"] if "tools" in can else [])


def _publisher(source: str) -> str:
    """Who published the model, as LM Studio names it by where its files are: a hub id's
    owner, a Hugging Face cache's owner, else the folder above the model's (LM Studio
    keeps publisher/model/, a GGUF file inside its model's folder)."""
    path = Path(source).expanduser()
    if not source or not path.exists():
        owner, _, rest = source.partition("/")
        return owner if rest else ""
    cached = next((part for part in path.parts if part.startswith("models--")), None)
    if cached is not None:
        return cached.split("--")[1]
    return (path.parent if path.is_dir() else path.parent.parent).name


def _format(facts: ModelFacts) -> str:
    return "gguf" if facts.format == "gguf" else "mlx"


def _quantization(facts: ModelFacts) -> str:
    """As LM Studio words it: an MLX model's bits ("4bit"); a GGUF's quantization as
    Ollama's words it ("Q4"), which it is converted at; else its weights' dtype."""
    if not facts.bits:
        return facts.dtype
    return f"Q{facts.bits}" if facts.format == "gguf" else f"{facts.bits}bit"


def _context_length(model: ServedModel) -> int | None:
    """Its context window; before its first load, what its config says it was trained
    for."""
    trained = model_config(model).get("max_position_embeddings")
    return model.context_length or (trained if isinstance(trained, int) else None)
