"""LM Studio 0.4's native chat, POST /api/v1/chat: one user turn (text, or text and
images) in, the reply's reasoning and message out as `output` items with LM Studio's
`stats`, answered by the same engines and cache as every other route.

Chats are stateful as LM Studio's are: unless `store` is false, the conversation is
kept under the reply's `response_id`, and a request naming it as `previous_response_id`
continues it (sending only its new turn; a `system_prompt` replaces the stored one).
Streamed (`stream: true`), the reply is LM Studio's named SSE events, from `chat.start`
to `chat.end`, which carries the whole result; an error after the first event is an
`error` event, and `chat.end` still follows with what was written. `integrations`
(plugins, MCP servers) run tools inside LM Studio and are a 400 here.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.api import SamplingKnobs
from engine.image_tokens import MARKER
from server.clock import Clock
from server.events import ChoiceFinished, Event, ReasoningDelta, TextDelta, Usage
from server.http.errors import APIError, params_renamed, shown
from server.http.json_body import JSONRoute
from server.http.loading import respond_with_model
from server.http.model_response import model_response
from server.http.openapi import error_responses
from server.http.streaming import (
    CLIENT_CLOSED,
    GenerationEventSource,
    NamedEvent,
    to_the_end,
)
from server.lmstudio.protocol import (
    ChatStats,
    InputItem,
    OutputText,
    V1ChatRequest,
    V1ChatResult,
    V1Error,
    V1ErrorResponse,
)
from server.lmstudio.routes import timings
from server.model_registry import Lease
from server.pipeline import GenerationRun, start
from server.request import (
    GenerationRequest,
    TemplateMessage,
    thinking_kwargs,
    turn_text,
    unset_knobs,
)
from server.responses.store import StoredResponse
from server.state import ServerState, server_state

router = APIRouter(prefix="/api/v1", responses=error_responses(V1ErrorResponse),
                   route_class=JSONRoute)

# The sampling fields of a v1 chat, by the sampler's names.
KNOBS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# Reasoning turned off or on at the model's own effort; the other values are levels.
SWITCHES = {"off": False, "on": True}


# The pipeline's refusals name Chat Completions' parameters; these are v1 chat's.
V1_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens"}


@router.post("/chat", responses={200: {"model": V1ChatResult,
                                       "content": {"text/event-stream": {}}}})
async def chat(body: V1ChatRequest, request: Request) -> Response:
    if body.integrations:
        raise APIError(400, "integrations (plugins and MCP servers) are not served: this "
                       "server runs no tools of its own", param="integrations")
    state = server_state(request)
    history, images = await _stored(state, body.previous_response_id)
    turn, turn_images = _turn(body.input)
    if body.system_prompt is not None:
        history = [{"role": "system", "content": body.system_prompt},
                   *(message for message in history if message["role"] != "system")]
    conversation = [*history, {"role": "user", "content": turn}]
    images += turn_images
    # A model loaded for this request says so, as LM Studio's events and stats do; a
    # stream says it at once (`_announced`), and that the load ended once it has.
    loading, clock = not state.models.is_ready(body.model), Clock()
    instance = state.models.name_for(state.models.lookup(body.model), body.model)
    announced = _announced(instance) if loading and body.stream else None

    async def respond(lease: Lease) -> Response:
        clock.ready()
        load_seconds = round(clock.durations().load / 1e9, 3) if loading else None
        if body.reasoning not in (None, "off") and "thinking" not in (
                lease.model.capabilities or []):
            raise APIError(400, f"model {shown(body.model)} does not reason: reasoning "
                           f"{body.reasoning!r} cannot be served", param="reasoning")
        with params_renamed(V1_PARAMS):
            run = await start(request, state, lease, _generation(body, conversation, images))
        reply = ChatReply(instance, load_seconds, announced=announced is not None)

        async def saved(result: V1ChatResult) -> V1ChatResult:
            if not body.store:
                return result
            return await _save(state, result, conversation, images)

        if body.stream:
            return GenerationEventSource(run, _events(request, run, reply, saved))
        done = await to_the_end(request, run, _consume(run, reply))
        if done is None:
            return Response(status_code=CLIENT_CLOSED)
        return model_response(await saved(reply.result(request)), exclude_none=True)

    return await respond_with_model(state.models, body.model, body.stream, respond,
                                    _error_event, opening=announced)


def _announced(instance: str) -> list[NamedEvent]:
    """What a stream that waits for its model to load sends at once."""
    return [_event("chat.start", model_instance_id=instance),
            _event("model_load.start", model_instance_id=instance)]


async def _stored(state: ServerState, response_id: str | None
                  ) -> tuple[list[TemplateMessage], list[str]]:
    """The conversation `response_id` ended, and its images in order (none: a new one)."""
    if response_id is None:
        return [], []
    stored = await asyncio.to_thread(state.chats.get, response_id)
    if stored is None:
        raise APIError(404, f"no stored chat has the response id {shown(response_id)}",
                       code="response_not_found", param="previous_response_id")
    return list(stored.conversation), list(stored.response["images"])


def _turn(items: str | list[InputItem]) -> tuple[str, list[str]]:
    """The user's turn as its text, each image a marker where it came, and the images."""
    if isinstance(items, str):
        return items, []
    pieces, images = [], []
    for number, item in enumerate(items):
        if item.type == "message":
            pieces.append(item.content)
            continue
        if not item.data_url.startswith("data:"):
            raise APIError(400, f"input[{number}].data_url: an image is sent as a base64 "
                           "data: URL", param=f"input[{number}].data_url")
        pieces.append(MARKER)
        images.append(item.data_url)
    return turn_text(pieces), images


def _generation(body: V1ChatRequest, conversation: list[TemplateMessage], images: list[str]
                ) -> GenerationRequest:
    knobs = {name: getattr(body, name) for name in KNOBS if getattr(body, name) is not None}
    return GenerationRequest(
        messages=tuple(conversation), images=tuple(images), sampling=SamplingKnobs(**knobs),
        unset_sampling=unset_knobs(body), max_tokens=body.max_output_tokens,
        # LM Studio's max_output_tokens is a cap; none writes until the model ends (or
        # the context does).
        fit_context=True, context_window=body.context_length, stream=body.stream,
        include_usage=True, chat_template_kwargs=thinking_kwargs(
            SWITCHES.get(body.reasoning, body.reasoning)))


class ChatReply:
    """One reply's events as LM Studio's output items (each run of reasoning or of
    message text one item) and, streamed, as its events. `load_seconds`: how long the
    request waited for its model to load (None: it was loaded)."""

    def __init__(self, model_instance_id: str, load_seconds: float | None,
                 announced: bool = False) -> None:
        self.model_instance_id = model_instance_id
        self.load_seconds = load_seconds
        self.announced = announced  # chat.start and model_load.start went out already
        self.output: list[OutputText] = []
        self.finished: ChoiceFinished | None = None
        self._prompt_done = False
        self._open: str | None = None  # the kind of the item being written

    def start(self) -> list[NamedEvent]:
        processing = _event("prompt_processing.start")
        if self.load_seconds is None:
            return [_event("chat.start", model_instance_id=self.model_instance_id), processing]
        opening = [] if self.announced else _announced(self.model_instance_id)
        loaded = _event("model_load.end", model_instance_id=self.model_instance_id,
                        load_time_seconds=self.load_seconds)
        return [*opening, loaded, processing]

    def events(self, event: Event) -> list[NamedEvent]:
        if isinstance(event, ChoiceFinished):
            self.finished = event
            return self.close()
        if not isinstance(event, TextDelta | ReasoningDelta) or not event.text:
            return []  # no tools are offered, so no call is read
        kind = "message" if isinstance(event, TextDelta) else "reasoning"
        out = self._prompt_processed()
        if self._open != kind:
            out += self._close_item()
            out.append(_event(f"{kind}.start"))
            self.output.append(OutputText(type=kind, content=""))
            self._open = kind
        self.output[-1].content += event.text
        out.append(_event(f"{kind}.delta", content=event.text))
        return out

    def close(self) -> list[NamedEvent]:
        """The events that end what is open: prompt processing, the item being written."""
        return self._prompt_processed() + self._close_item()

    def _prompt_processed(self) -> list[NamedEvent]:
        if self._prompt_done:
            return []
        self._prompt_done = True
        return [_event("prompt_processing.end")]

    def _close_item(self) -> list[NamedEvent]:
        if self._open is None:
            return []
        kind, self._open = self._open, None
        return [_event(f"{kind}.end")]

    def result(self, request: Request) -> V1ChatResult:
        """The whole reply; cut short by an error, what was written (no counts)."""
        usage = self.finished.usage if self.finished is not None else Usage()
        timing = timings(request, usage.completion_tokens)
        return V1ChatResult(
            model_instance_id=self.model_instance_id, output=self.output,
            stats=ChatStats(
                input_tokens=usage.prompt_tokens, total_output_tokens=usage.completion_tokens,
                reasoning_output_tokens=usage.reasoning_tokens or 0,
                tokens_per_second=timing["tokens_per_second"],
                time_to_first_token_seconds=timing["time_to_first_token"],
                model_load_time_seconds=self.load_seconds))


async def _consume(run: GenerationRun, reply: ChatReply) -> bool:
    async for event in run.events():
        reply.events(event)
    return True


Save = Callable[[V1ChatResult], Awaitable[V1ChatResult]]


async def _events(request: Request, run: GenerationRun, reply: ChatReply, saved: Save | None
                  ) -> AsyncIterator[list[NamedEvent]]:
    """Each list goes out in one write: what one generation event becomes."""
    yield reply.start()
    try:
        async for event in run.events():
            yield reply.events(event)
    except APIError as error:
        # The status line is sent: the error is an event, and chat.end still carries what
        # was written (not stored: the reply is not whole).
        yield [*reply.close(), _error_event(error)]
        saved = None
    result = reply.result(request)
    if saved is not None:
        result = await saved(result)
    yield [_event("chat.end", result=result.model_dump(exclude_none=True))]


async def _save(state: ServerState, result: V1ChatResult,
                conversation: list[TemplateMessage], images: list[str]) -> V1ChatResult:
    """`result` with the id its conversation, the reply included, is stored under."""
    reply: TemplateMessage = {"role": "assistant", "content": turn_text(
        item.content for item in result.output if item.type == "message")}
    reasoning = turn_text(item.content for item in result.output if item.type == "reasoning")
    if reasoning:
        reply["reasoning_content"] = reasoning
    response_id = f"resp_{uuid.uuid4().hex}"
    result = result.model_copy(update={"response_id": response_id})
    # A follow-up reads the conversation and its images; nothing reads a chat back by id.
    entry = StoredResponse({"images": images}, [*conversation, reply])
    await asyncio.to_thread(state.chats.put, response_id, entry)
    return result


def _event(kind: str, **fields: Any) -> NamedEvent:
    return NamedEvent(kind, json.dumps({"type": kind, **fields}))


def _error_event(error: APIError) -> NamedEvent:
    body: V1Error = error.lmstudio_body().error
    return _event("error", error=body.model_dump(exclude_none=True))
