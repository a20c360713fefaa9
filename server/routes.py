"""The HTTP endpoints: OpenAI's /v1 API, plus /health and /metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine, Sequence
from functools import partial
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from sse_starlette import EventSourceResponse
from starlette.types import Receive, Scope, Send

from engine.api import Lifecycle
from server.errors import APIError
from server.formats import ChatFormat, CompletionFormat, Format
from server.jobs import Delta, Job, collect, deltas
from server.metrics import CONTENT_TYPE
from server.prompts import chat_prompt, check_token_ids, completion_prompts
from server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    SamplingRequest,
)
from server.state import ServerState, server_state
from server.tools import ToolCallParser

T = TypeVar("T")

# nginx's "client closed request": logged for a non-streaming request whose client left.
CLIENT_CLOSED = 499

# What the OpenAPI schema declares: every /v1 failure is OpenAI's error object. "4XX"
# covers the rest (e.g. 405) and keeps FastAPI from declaring a 422 we never send.
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in {
        400: "Invalid request, or prompt + max_tokens over the context window.",
        401: "Missing or wrong API key.",
        404: "Unknown model.",
        413: "Body over the server's max_body_bytes.",
        429: "Queue full; retry after Retry-After seconds.",
        500: "The engine failed this request; the message names the request id.",
        503: "The model is loading or failed to load, or the server is shutting down.",
        "4XX": "Any other client error.",
    }.items()
}


def _inline(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s JSON schema with its definitions inlined: nothing else refers to them."""
    schema = model.model_json_schema(mode="serialization")
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return resolve(defs[node["$ref"].rsplit("/", 1)[1]])
            return {key: resolve(value) for key, value in node.items()}
        return [resolve(item) for item in node] if isinstance(node, list) else node

    return resolve(schema)


def _events(chunk: type[BaseModel]) -> dict[str, Any]:
    """A stream's events: `chunk`s, an error object (a failure after the status line was
    sent), then `[DONE]`."""
    data = {"type": "string", "contentMediaType": "application/json",
            "contentSchema": {"anyOf": [_inline(chunk), _inline(ErrorResponse)]}}
    event = {"type": "object", "required": ["data"],
             "properties": {"data": {"anyOf": [{"const": "[DONE]"}, data]}}}
    return {"text/event-stream": {"schema": event}}


api = APIRouter(prefix="/v1", responses=ERRORS)
probes = APIRouter()


@api.get("/models")
async def list_models(request: Request) -> ModelList:
    state = server_state(request)
    return ModelList(data=[_model_card(state, name) for name in state.model_ids()])


@api.get("/models/{model:path}")
async def get_model(model: str, request: Request) -> ModelCard:
    state = server_state(request)
    return _model_card(state, state.check_model(model))


def _model_card(state: ServerState, name: str) -> ModelCard:
    return ModelCard(id=name, created=state.started, root=state.engine.model_id)


@api.post("/chat/completions", responses={
    200: {"model": ChatCompletionResponse, "content": _events(ChatCompletionChunk)}})
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = server_state(request)
    tokenizer = state.ready_tokenizer()
    model = state.check_model(body.model)
    # Rendering and tokenizing a long conversation takes milliseconds: off the event loop,
    # so streams in flight keep flowing meanwhile.
    prompt = await asyncio.to_thread(chat_prompt, tokenizer, body)
    max_tokens = body.completion_limit or max(
        1, min(state.settings.default_max_tokens, state.engine.context_length - len(prompt))
    )
    tool_parser = None
    calls = tokenizer.tool_calls
    if body.template_tools and calls is not None:
        tool_parser = partial(
            ToolCallParser, calls.start, calls.end, calls.parse, body.template_tools
        )
    job = _submit(request, state, body, [prompt], max_tokens, body.engine_logprobs)
    fmt = ChatFormat(f"chatcmpl-{job.request_id}", model, body.logprobs)
    return await _respond(request, job, fmt, deltas(job, tool_parser), body)


@api.post("/completions", responses={
    200: {"model": CompletionResponse, "content": _events(CompletionResponse)}})
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = server_state(request)
    tokenizer = state.ready_tokenizer()
    model = state.check_model(body.model)
    prompts = await asyncio.to_thread(completion_prompts, tokenizer, body)
    job = _submit(request, state, body, prompts, body.max_tokens, body.logprobs)
    fmt = CompletionFormat(f"cmpl-{job.request_id}", model, body.logprobs is not None)
    return await _respond(request, job, fmt, deltas(job), body)


def _submit(
    request: Request,
    state: ServerState,
    body: SamplingRequest,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    logprobs: int | None,
) -> Job:
    vocab_size = state.engine.tokenizer.vocab_size
    check_token_ids(map(int, body.logit_bias or ()), vocab_size, "logit_bias")
    check_token_ids(body.stop_token_ids or (), vocab_size, "stop_token_ids")
    choices = len(prompts) * body.n
    if choices > state.settings.max_queue:
        # All are queued at once, so the engine would refuse this request every time.
        raise APIError(
            400, f"{choices} choices (prompts x n) exceed this server's queue of "
            f"{state.settings.max_queue}", code="invalid_request", param="n",
        )
    job = Job(state.engine, state.drain, state.metrics, request.state.request_id,
              request.state.started_at)
    request.state.stats = job.stats
    job.submit(prompts, body.n, lambda choice: body.sampling_params(max_tokens, logprobs, choice))
    return job


async def _respond(
    request: Request, job: Job, fmt: Format, stream: AsyncIterator[Delta], body: SamplingRequest
) -> Response:
    if body.stream:
        return JobEventSource(job, _sse(job, fmt, stream, body.include_usage))
    try:
        results = await _unless_disconnected(request, collect(job, stream))
    finally:
        job.close()
    if results is None:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(fmt.response(results, job.usage()).model_dump())


class JobEventSource(EventSourceResponse):
    """An SSE response that closes its job however the response ends: finished, failed,
    or cut short by a client disconnect (even before the first event)."""

    def __init__(self, job: Job, events: AsyncIterator[str]) -> None:
        super().__init__(events)
        self.job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.close()


async def _sse(
    job: Job, fmt: Format, stream: AsyncIterator[Delta], include_usage: bool
) -> AsyncIterator[str]:
    """The SSE data lines, ending with `[DONE]` (after an error object if one occurs)."""
    # OpenAI sends `"usage": null` on every chunk only when usage was asked for.
    exclude = None if include_usage else {"usage"}
    try:
        for chunk in fmt.opening_chunks(job.choices):
            yield chunk.model_dump_json(exclude=exclude)
        async for delta in stream:
            chunk = fmt.chunk(delta)
            if chunk is not None:
                yield chunk.model_dump_json(exclude=exclude)
        if include_usage:
            yield fmt.usage_chunk(job.usage()).model_dump_json()
    except APIError as error:
        # The status line is sent already: the error travels as a data event, as in vLLM.
        yield error.body().model_dump_json()
    yield "[DONE]"


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """`work`'s result, or None if the client disconnects first: Starlette does not cancel
    a handler whose client went away, so we watch for it ourselves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() else None


async def _disconnect(request: Request) -> None:
    # The body is read already, so the next message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
