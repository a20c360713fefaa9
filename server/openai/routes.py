"""OpenAI's /v1 endpoints: Chat Completions, Completions and Models; Mistral's fill in
the middle, which answers in Chat Completions' shapes; and DeepSeek's, which is
Completions with a suffix under its beta base URL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from server.events import ChoiceFinished, ChoiceResult, collect
from server.http.errors import APIError
from server.http.json_body import JSONRoute
from server.http.loading import respond_with_model
from server.http.model_response import model_response
from server.http.openapi import error_responses, event_stream
from server.http.streaming import CLIENT_CLOSED, GenerationEventSource, to_the_end
from server.model_facts import context_window
from server.model_registry import Lease, ServedModel
from server.openai.adapter import (
    chat_request,
    completion_request,
    custom_tool_names,
    fim_request,
)
from server.openai.formats import ChatFormat, CompletionFormat, FimFormat, Format
from server.openai.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    FimCompletionRequest,
    ModelCard,
    ModelList,
)
from server.pipeline import GenerationRun, start
from server.state import ServerState, server_state
from server.structured import forces_call

# A front end that answers in OpenAI's objects with fields of its own (LM Studio's
# stats): OpenAI's whole response, and the choices it was made of, as that front end's.
Dress = Callable[[ChatCompletionResponse | CompletionResponse, list[ChoiceResult]], BaseModel]


def _events(chunk: type[BaseModel]) -> dict[str, Any]:
    return event_stream(chunk, ErrorResponse, done=True)


api = APIRouter(prefix="/v1", responses=error_responses(ErrorResponse),
                route_class=JSONRoute)
# DeepSeek's beta base URL (https://api.deepseek.com/beta), where it serves fill in the
# middle as Completions with a `suffix`, and chat prefix completion (a final assistant
# message with `prefix: true`): clients set up for it reach ours.
deepseek_beta = APIRouter(prefix="/beta", responses=error_responses(ErrorResponse),
                          route_class=JSONRoute)


@api.get("/models")
async def list_models(request: Request) -> ModelList:
    """Every configured model under each of its names, loaded or not (`state` says)."""
    state = server_state(request)
    cards = [_model_card(state, model, name) for model in state.models.models
             for name in state.models.names_of(model)]
    return ModelList(data=cards, first_id=cards[0].id, last_id=cards[-1].id)


@api.get("/models/{model:path}")
async def get_model(model: str, request: Request) -> ModelCard:
    state = server_state(request)
    served = state.models.lookup(model)
    return _model_card(state, served, state.models.name_for(served, model))


def _model_card(state: ServerState, model: ServedModel, name: str) -> ModelCard:
    created_at = datetime.fromtimestamp(state.started, UTC).isoformat().replace("+00:00", "Z")
    return ModelCard(id=name, created=state.started, root=model.id, display_name=name,
                     created_at=created_at, max_input_tokens=context_window(model),
                     state=model.state.value, pinned=model.spec.pinned)


@deepseek_beta.post("/chat/completions", include_in_schema=False)
@api.post("/chat/completions", responses={
    200: {"model": ChatCompletionResponse, "content": _events(ChatCompletionChunk)}})
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    return await chat_completion(body, request)


async def chat_completion(body: ChatCompletionRequest, request: Request,
                          dress: Dress | None = None) -> Response:
    """Chat Completions; `dress`: a front end's own over the whole response."""
    state = server_state(request)

    async def respond(lease: Lease) -> Response:
        lease.model.keep(body.ttl)
        generation = await start(request, state, lease, chat_request(body))
        model = state.models.name_for(lease.model, body.model)
        fmt = ChatFormat(f"chatcmpl-{generation.request_id}", model, body.logprobs,
                         calls_only=forces_call(generation.request),
                         custom_tools=custom_tool_names(body),
                         tier_asked=body.service_tier is not None)
        return await _respond(request, generation, fmt, dress)

    return await respond_with_model(state.models, body.model, body.stream, respond,
                                    _stream_error)


@deepseek_beta.post("/completions", include_in_schema=False)
@api.post("/completions", responses={
    200: {"model": CompletionResponse, "content": _events(CompletionResponse)}})
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    return await completion(body, request)


async def completion(body: CompletionRequest, request: Request,
                     dress: Dress | None = None) -> Response:
    """Completions; `dress`: a front end's own over the whole response."""
    state = server_state(request)

    async def respond(lease: Lease) -> Response:
        lease.model.keep(body.ttl)
        generation = await start(request, state, lease, completion_request(body))
        model = state.models.name_for(lease.model, body.model)
        fmt = CompletionFormat(f"cmpl-{generation.request_id}", model,
                               body.logprobs is not None)
        return await _respond(request, generation, fmt, dress)

    return await respond_with_model(state.models, body.model, body.stream, respond,
                                    _stream_error)


@api.post("/fim/completions", responses={
    200: {"model": ChatCompletionResponse, "content": _events(ChatCompletionChunk)}})
async def create_fim_completion(body: FimCompletionRequest, request: Request) -> Response:
    """Mistral's fill in the middle (Codestral's API): the model's own fill-in-the-middle
    prompt (engine/fill_in_middle.py), as Completions' `suffix` makes it."""
    state = server_state(request)

    async def respond(lease: Lease) -> Response:
        generation = await start(request, state, lease, fim_request(body))
        model = state.models.name_for(lease.model, body.model)
        return await _respond(request, generation,
                              FimFormat(f"cmpl-{generation.request_id}", model, False))

    return await respond_with_model(state.models, body.model, body.stream, respond,
                                    _stream_error)


def _stream_error(error: APIError) -> list[str]:
    """An error before the first chunk of a stream whose status line went out already."""
    return [error.body().model_dump_json(), "[DONE]"]


async def _respond(request: Request, generation: GenerationRun, fmt: Format,
                   dress: Dress | None = None) -> Response:
    if generation.request.stream:
        return GenerationEventSource(generation, _sse(generation, fmt))
    results = await to_the_end(
        request, generation, collect(generation.events(), generation.choices)
    )
    if results is None:
        return Response(status_code=CLIENT_CLOSED)
    # Off the event loop: with logprobs an answer is an object per alternative token (16
    # choices of 1,500 tokens at top_logprobs 20: half a million, 43 MB of JSON), and
    # built on the loop it froze every other stream for 16 s.
    response = await asyncio.to_thread(fmt.response, results, generation.usage())
    if dress is not None:
        response = dress(response, results)
    return await asyncio.to_thread(model_response, response)


async def _sse(generation: GenerationRun, fmt: Format) -> AsyncIterator[str | list[str]]:
    """The SSE data lines, ending with `[DONE]` (after an error object if one occurs).

    The last choice's finishing chunk waits for the usage chunk and `[DONE]`, which follow
    it at once, so the three go out in one write rather than three."""
    include_usage = generation.request.include_usage
    # OpenAI sends `"usage": null` on every chunk only when usage was asked for.
    exclude = frozenset() if include_usage else frozenset({"usage"})
    tail: list[str] = []
    unfinished = generation.choices
    try:
        yield [chunk.model_dump_json(exclude=exclude)
               for chunk in fmt.opening_chunks(generation.choices)]
        async for event in generation.events():
            data = fmt.chunk_json(event, exclude)
            if isinstance(event, ChoiceFinished):
                unfinished -= 1
                if not unfinished and data is not None:
                    tail.append(data)
                    continue
            if data is not None:
                yield data
        if include_usage:
            tail.append(fmt.usage_chunk(generation.usage()).model_dump_json())
    except APIError as error:
        # The status line is sent already: the error travels as a data event, as in vLLM.
        tail.append(error.body().model_dump_json())
    yield [*tail, "[DONE]"]
