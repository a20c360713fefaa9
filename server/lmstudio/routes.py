"""LM Studio's own REST API, v0 (/api/v0): what tools written for LM Studio's server call
beside its OpenAI-compatible /v1, answered by the same engines and cache.

GET /api/v0/models lists every configured model under each of its names, loaded or not,
as LM Studio describes its models: type, publisher, architecture, format
(`compatibility_type`), quantization, state and context window. Chat Completions,
Completions and Embeddings take OpenAI's bodies and are our OpenAI routes'; a whole
chat or completion adds LM Studio's `stats` (tokens per second, time to first token,
generation time, why it stopped), `model_info` and `runtime`. Streamed, they are OpenAI's
chunks, as LM Studio streams them. Errors are OpenAI's error object, as LM Studio's are.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.events import ChoiceResult
from server.http.access_log import RequestStats
from server.http.json_body import JSONRoute
from server.http.openapi import error_responses
from server.lmstudio.models import describe
from server.lmstudio.protocol import (
    ChatCompletion,
    ChatRequest,
    Completion,
    ModelEntry,
    ModelInfo,
    ModelList,
    Runtime,
    Stats,
    StopReason,
    TextRequest,
)
from server.model_registry import ServedModel
from server.openai.protocol import ChatCompletionResponse, CompletionResponse, ErrorResponse
from server.openai.routes import Dress, chat_completion, completion
from server.prefill.protocol import EmbeddingResponse
from server.prefill.routes import create_embeddings
from server.state import server_state
from server.worker_info import server_version

router = APIRouter(prefix="/api/v0", responses=error_responses(ErrorResponse),
                   route_class=JSONRoute)
router.add_api_route("/embeddings", create_embeddings, methods=["POST"],
                    response_model=EmbeddingResponse)

# The model formats this server loads: MLX's safetensors directories, and GGUF files
# (converted to them as they load).
SUPPORTED_FORMATS = ["safetensors", "gguf"]


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
    described = describe(model)
    return ModelEntry(
        id=name, type=described.type, publisher=described.publisher, arch=described.arch,
        compatibility_type=described.format, quantization=described.quantization,
        state="loaded" if described.loaded else "not-loaded",
        max_context_length=described.max_context_length,
        capabilities=["tool_use"] if described.tool_use else [])


# -- generation -----------------------------------------------------------------------------


@router.post("/chat/completions", responses={200: {"model": ChatCompletion}})
async def chat_completions(body: ChatRequest, request: Request) -> Response:
    return await chat_completion(body, request, _dress(ChatCompletion, request, body.model))


@router.post("/completions", responses={200: {"model": Completion}})
async def completions(body: TextRequest, request: Request) -> Response:
    return await completion(body, request, _dress(Completion, request, body.model))


def _dress(kind: type[ChatCompletion | Completion], request: Request, name: str | None
           ) -> Dress:
    """OpenAI's whole answer as LM Studio's, with its stats and its model's info."""
    def dress(response: ChatCompletionResponse | CompletionResponse,
              results: list[ChoiceResult]) -> ChatCompletion | Completion:
        return kind(**dict(response), **_extras(request, name, results))

    return dress


def _extras(request: Request, name: str | None, results: list[ChoiceResult]
            ) -> dict[str, Any]:
    """LM Studio's fields beside OpenAI's: the first choice's stats (LM Studio makes
    one), the model's info and this server's."""
    model = server_state(request).models.lookup(name)
    described = describe(model)
    return {"stats": _stats(request, results[0]),
            "model_info": ModelInfo(arch=described.arch, quant=described.quantization,
                                    format=described.format,
                                    context_length=model.context_length),
            "runtime": Runtime(name="radix-mlx", version=server_version(),
                               supported_formats=SUPPORTED_FORMATS)}


def _stats(request: Request, result: ChoiceResult) -> Stats:
    stats: RequestStats = request.state.stats
    return Stats(**timings(request, stats.completion_tokens), stop_reason=_stop_reason(result))


def timings(request: Request, completion_tokens: int) -> dict[str, float]:
    """The request's timings so far, as its job took them (what the access log reports):
    the first token from the request's arrival, then the rest to now, in seconds to the
    millisecond, which the rate of `completion_tokens` is of, as LM Studio's."""
    end = time.perf_counter()
    first = request.state.stats.first_token_at or end
    generation = round(end - first, 3)
    return {"tokens_per_second": completion_tokens / generation if generation else 0.0,
            "time_to_first_token": round(first - request.state.started_at, 3),
            "generation_time": generation}


def _stop_reason(result: ChoiceResult) -> StopReason:
    if result.finish_reason == "tool_calls":
        return "toolCalls"
    if result.finish_reason == "length":
        return "maxPredictedTokensReached"
    # A stop token id (the end of sequence among them) is the model's own end.
    return "stopStringFound" if isinstance(result.matched_stop, str) else "eosFound"
