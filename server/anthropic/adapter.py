"""Anthropic's Messages API onto the shared pipeline: `/v1/messages` and
`/v1/messages/count_tokens`.

A thin adapter: the request becomes a `GenerationRequest` (system and content blocks
into chat messages, tools, tool_choice, thinking, output format, sampling), the shared
pipeline runs it, and its neutral events come back as Anthropic's content blocks, or as
Anthropic's stream events (message_start, content_block_start/delta/stop, message_delta,
message_stop, with ping events while the prompt is computed).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel
from pydantic_core import from_json

from engine.api import SamplingKnobs
from engine.image_tokens import MARKER
from server.anthropic.defined_tools import DEFINED_TOOLS
from server.anthropic.protocol import (
    AnthropicDefinedTool,
    AnthropicMessage,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    DocumentBlock,
    ErrorResponse,
    ImageBlock,
    InputJsonDelta,
    MessageDelta,
    MessageDeltaBody,
    MessageResponse,
    MessagesRequest,
    MessageStart,
    MessageStop,
    Ping,
    ResponseContent,
    SearchResultBlock,
    StopReason,
    StreamEvent,
    System,
    TextBlock,
    TextContent,
    TextDelta,
    ThinkingBlock,
    ThinkingContent,
    ThinkingDelta,
    ThinkingDisabled,
    TokenCount,
    TokenCountRequest,
    Tool,
    ToolChoice,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseContent,
    Usage,
)
from server.events import (
    ChoiceFinished,
    ChoiceResult,
    Event,
    ReasoningDelta,
    ToolCallArguments,
    ToolCallStarted,
    collect,
)
from server.events import TextDelta as TextEvent
from server.events import Usage as GenerationUsage
from server.http.errors import APIError, request_id_of
from server.http.json_body import JSONRoute
from server.http.loading import respond_with_model
from server.http.model_response import model_response
from server.http.openapi import error_responses, event_stream
from server.http.streaming import CLIENT_CLOSED, GenerationEventSource, NamedEvent, to_the_end
from server.model_registry import Lease
from server.partial_json import JsonStart, json_start
from server.pipeline import GenerationRun, render, start
from server.prompts import assistant_prefill
from server.request import (
    TEXT,
    FunctionTool,
    GenerationRequest,
    JsonSchemaOutput,
    NamedFunction,
    TemplateMessage,
    template_call,
    turn_text,
    unset_knobs,
)
from server.request import ToolChoice as GenerationToolChoice
from server.state import server_state

# -- request ------------------------------------------------------------------------------

# How Anthropic's tool_use ids begin (OpenAI's APIs keep "call_").
TOOL_USE_ID_PREFIX = "toolu_"


def generation_request(body: TokenCountRequest) -> GenerationRequest:
    messages: list[TemplateMessage] = []
    system = system_text(body.system)
    if system:
        messages.append({"role": "system", "content": system})
    for message in body.messages:
        messages += chat_messages(message)
    # A final assistant message is a prefill: the reply continues it.
    messages, chat_end = assistant_prefill(messages)
    if not messages:
        raise APIError(400, "messages: the only message is an empty assistant message, "
                       "which leaves nothing to reply to", param="messages")
    output = TEXT
    if body.output_config is not None and body.output_config.format is not None:
        output = JsonSchemaOutput("output", body.output_config.format.schema_, strict=True)
    template_kwargs = {}
    if body.thinking is not None:
        template_kwargs["enable_thinking"] = not isinstance(body.thinking, ThinkingDisabled)
    request = GenerationRequest(
        messages=tuple(messages),
        images=tuple(url for message in body.messages for url in message.images),
        tools=tuple(_function(tool) for tool in body.tools or ()),
        tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=_parallel(body.tool_choice),
        call_id_prefix=TOOL_USE_ID_PREFIX,
        output=output,
        chat_template_kwargs=template_kwargs,
        chat_end=chat_end,
    )
    if not isinstance(body, MessagesRequest):
        return request  # counting tokens: the prompt is all there is
    knobs = SamplingKnobs(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        stop=tuple(body.stop_sequences or ()),
        speculation=body.speculation,
    )
    return replace(request, sampling=knobs, unset_sampling=unset_knobs(body),
                   max_tokens=body.max_tokens, fit_context=True, stream=body.stream,
                   include_usage=True, usage_at_start=body.stream)


def system_text(system: System | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "\n".join(block.text for block in system)


# The blocks a message's text is made of, in order: an image is its marker there.
READ_BLOCKS = (TextBlock, ImageBlock, DocumentBlock, SearchResultBlock)


def chat_messages(message: AnthropicMessage) -> list[TemplateMessage]:
    """One Anthropic message as chat messages: a user turn's tool results become tool
    messages (first, as they answer the previous assistant turn), an assistant turn's
    tool_use blocks its tool calls and its thinking its reasoning. A system message stays
    one at its place (the pipeline fits it to the template: `server.conversation`)."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    blocks = message.content
    text = turn_text(MARKER if isinstance(block, ImageBlock) else block.text
                     for block in blocks if isinstance(block, READ_BLOCKS))
    if message.role == "system":
        return [{"role": "system", "content": text}]
    if message.role == "user":
        results: list[TemplateMessage] = [
            {"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block)}
            for block in blocks if isinstance(block, ToolResultBlock)
        ]
        has_text = any(isinstance(block, READ_BLOCKS) for block in blocks)
        return results + ([{"role": "user", "content": text}] if has_text or not results else [])
    out: TemplateMessage = {"role": "assistant", "content": text}
    reasoning = "".join(block.thinking for block in blocks if isinstance(block, ThinkingBlock))
    if reasoning:
        out["reasoning_content"] = reasoning
    calls = [template_call(block.id, block.name, block.input)
             for block in blocks if isinstance(block, ToolUseBlock)]
    if calls:
        out["tool_calls"] = calls
    return [out]


def _result_text(block: ToolResultBlock) -> str:
    content = block.content
    text = content if isinstance(content, str) else "\n".join(
        MARKER if isinstance(part, ImageBlock) else part.text for part in content)
    # Anthropic's models see is_error; a chat template has no field for it.
    return f"Error: {text}" if block.is_error else text


def _parallel(choice: ToolChoice | None) -> bool | None:
    disabled = getattr(choice, "disable_parallel_tool_use", None)
    return None if disabled is None else not disabled


def _function(tool: Tool | AnthropicDefinedTool) -> FunctionTool:
    if isinstance(tool, AnthropicDefinedTool):
        defined = DEFINED_TOOLS[tool.type]
        return FunctionTool(tool.name, defined.description, defined.input_schema)
    return FunctionTool(tool.name, tool.description, tool.input_schema, tool.strict)


def _tool_choice(choice: ToolChoice | None) -> GenerationToolChoice:
    if isinstance(choice, ToolChoiceTool):
        return NamedFunction(choice.name)
    if isinstance(choice, ToolChoiceAny):
        return "required"
    return "none" if isinstance(choice, ToolChoiceNone) else "auto"


# -- response -----------------------------------------------------------------------------


def usage(counts: GenerationUsage) -> Usage:
    """Anthropic's `input_tokens` leaves out what came from the cache."""
    return Usage(
        input_tokens=counts.prompt_tokens - counts.cached_tokens,
        output_tokens=counts.completion_tokens,
        cache_read_input_tokens=counts.cached_tokens,
    )


def stop_reason(
    reason: str, matched_stop: str | int | None, context_bound: bool
) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence). A reply cut short of `max_tokens` by the end of the
    context window (`GenerationRun.context_bound`) says so, as Anthropic's newer models do."""
    if reason == "tool_calls":
        return "tool_use", None
    if reason == "length":
        return ("model_context_window_exceeded" if context_bound else "max_tokens"), None
    if isinstance(matched_stop, str):
        return "stop_sequence", matched_stop
    return "end_turn", None


def message_response(
    message_id: str, model: str, context_bound: bool, result: ChoiceResult,
    omit_thinking: bool = False,
) -> MessageResponse:
    content: list[ResponseContent] = []
    if result.reasoning:
        content.append(ThinkingContent(thinking="" if omit_thinking else result.reasoning))
    # Text and calls in the order the model wrote them, as the stream's blocks are.
    written = 0
    for call in result.tool_calls:
        if text := result.text[written:call.after_text]:
            content.append(TextContent(text=text))
        content.append(ToolUseContent(id=call.id, name=call.name,
                                      input=_tool_input(call.arguments)))
        written = call.after_text
    if text := result.text[written:]:
        content.append(TextContent(text=text))
    reason, sequence = stop_reason(result.finish_reason, result.matched_stop, context_bound)
    return MessageResponse(
        id=message_id, model=model, content=content, stop_reason=reason,
        stop_sequence=sequence, usage=usage(result.usage),
    )


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's `input` is. Arguments cut short (max
    tokens) read as far as they go, as the SDKs read a stream's input_json_deltas (jiter's
    partial mode, which pydantic-core's `from_json` is), so a message and its stream give
    one input; so does an object that stops being JSON partway, as far as it is JSON (its
    stream can send no more: `JsonStart`). A model that wrote something
    other than an object still gets its text through, under one key."""
    text = arguments.strip()
    try:
        value = from_json(json_start(text) if text.startswith("{") else text or "{}",
                          allow_partial=True)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"arguments": arguments}


class MessageStream:
    """Neutral events as Anthropic's stream events: one content block at a time, in
    order; a block closes when the next kind of content begins."""

    def __init__(self, message_id: str, model: str, context_bound: bool,
                 omit_thinking: bool = False) -> None:
        self.message_id, self.model, self.context_bound = message_id, model, context_bound
        self.omit_thinking = omit_thinking  # a thinking block opens, and gets no deltas
        self._index = -1
        self._open: str | None = None  # "text", "thinking" or "tool_use"
        # The open call's arguments until they show whether they are an object: only an
        # object streams as it comes; anything else goes out whole at the block's end,
        # under one key, as `_tool_input` gives it in a message.
        self._arguments: str | None = None
        # The open call's object as sent.
        self._object = JsonStart()

    def opening(self, prompt_tokens: int, cached_tokens: int) -> list[StreamEvent]:
        """`cached_tokens`: what the cache held of the prompt before the engine started;
        message_delta's usage gives what the engine found (an eviction meanwhile can
        make it less, another request's prefill more)."""
        start = MessageResponse(
            id=self.message_id, model=self.model, content=[], stop_reason=None,
            stop_sequence=None,
            usage=usage(GenerationUsage(prompt_tokens=prompt_tokens, cached_tokens=cached_tokens)),
        )
        return [MessageStart(message=start), Ping()]

    def event(self, event: Event) -> list[StreamEvent]:
        if isinstance(event, TextEvent):
            return self._delta("text", TextContent(text=""), TextDelta(text=event.text),
                               bool(event.text))
        if isinstance(event, ReasoningDelta):
            if self.omit_thinking:
                if not event.text or self._open == "thinking":
                    return []
                return self._close() + self._start("thinking", ThinkingContent(thinking=""))
            return self._delta("thinking", ThinkingContent(thinking=""),
                               ThinkingDelta(thinking=event.text), bool(event.text))
        if isinstance(event, ToolCallStarted):
            block = ToolUseContent(id=event.id, name=event.name, input={})
            events = self._close() + self._start("tool_use", block)
            self._arguments, self._object = "", JsonStart()
            return events
        if isinstance(event, ToolCallArguments):
            return self._arguments_delta(event.fragment)
        return self._finish(event)

    def _arguments_delta(self, fragment: str) -> list[StreamEvent]:
        if self._arguments is None:  # an object: it streams
            fragment = self._object.add(fragment)
            return self._delta("tool_use", None, InputJsonDelta(partial_json=fragment),
                               bool(fragment))
        self._arguments += fragment
        if not self._arguments.lstrip().startswith("{"):
            return []  # undecided, or not an object: `_close` sends it
        fragment, self._arguments = self._arguments, None
        return self._arguments_delta(fragment)

    def _delta(self, kind: str, block: ResponseContent | None, delta: Any, nonempty: bool):
        if not nonempty:
            return []
        events: list[StreamEvent] = []
        if self._open != kind:
            events += self._close() + self._start(kind, block)
        return [*events, ContentBlockDelta(index=self._index, delta=delta)]

    def _start(self, kind: str, block: ResponseContent) -> list[StreamEvent]:
        self._index += 1
        self._open = kind
        return [ContentBlockStart(index=self._index, content_block=block)]

    def _close(self) -> list[StreamEvent]:
        if self._open is None:
            return []
        events: list[StreamEvent] = []
        if self._open == "tool_use" and self._arguments:
            verbatim = json.dumps(_tool_input(self._arguments))
            events.append(ContentBlockDelta(index=self._index,
                                            delta=InputJsonDelta(partial_json=verbatim)))
        self._open, self._arguments = None, None
        return [*events, ContentBlockStop(index=self._index)]

    def _finish(self, finished: ChoiceFinished) -> list[StreamEvent]:
        reason, sequence = stop_reason(finished.reason, finished.matched_stop,
                                       self.context_bound)
        return [
            *self._close(),
            MessageDelta(delta=MessageDeltaBody(stop_reason=reason, stop_sequence=sequence),
                         usage=usage(finished.usage)),
            MessageStop(),
        ]


def _sse(event: BaseModel) -> NamedEvent:
    """Anthropic names every event after its type."""
    return NamedEvent(event.type, event.model_dump_json())


async def _stream(
    generation: GenerationRun, stream: MessageStream
) -> AsyncIterator[list[NamedEvent]]:
    """Each list goes out in one write: what one generation event becomes."""
    try:
        yield [_sse(event) for event in stream.opening(generation.prompt_tokens,
                                                        generation.cached_tokens)]
        async for event in generation.events():
            yield [_sse(out) for out in stream.event(event)]
    except APIError as error:
        # The status line is sent already: the error travels as an `error` event.
        yield [_sse(error.anthropic_body(generation.request_id))]


# -- routes -------------------------------------------------------------------------------


class ThreadNotHeld(APIError):
    """A request in a message thread, which this server does not hold: Anthropic's
    `thread_unsupported_request`, on which the SDKs' tool runners (threaded by default)
    send the turn again with the whole conversation and stop threading."""

    def __init__(self) -> None:
        super().__init__(400, "thread: message threads are not held by this server; send "
                              "the whole conversation without thread",
                         code="thread_unsupported_request", param="thread")

    def anthropic_body(self, request_id: str | None = None) -> ErrorResponse:
        body = super().anthropic_body(request_id)
        body.error.details = {"error_code": self.code, "unsupported": ["thread"]}
        return body


# The beta (anthropic-beta: interleaved-thinking-2025-05-14) under which thinking
# continues between tool calls, its budget spanning them all.
INTERLEAVED_THINKING = "interleaved-thinking"

router = APIRouter(prefix="/v1", responses=error_responses(ErrorResponse),
                   route_class=JSONRoute)


@router.post("/messages", responses={
    200: {"model": MessageResponse, "content": event_stream(StreamEvent, ErrorResponse)}})
async def create_message(body: MessagesRequest, request: Request) -> Response:
    if body.thread is not None:
        raise ThreadNotHeld()
    if body.thinking_over_budget(INTERLEAVED_THINKING in request.headers.get("anthropic-beta", "")):
        raise APIError(400, "`max_tokens` must be greater than `thinking.budget_tokens`",
                       param="max_tokens")
    state = server_state(request)

    async def respond(lease: Lease) -> Response:
        generation = await start(request, state, lease, generation_request(body))
        model = state.models.name_for(lease.model, body.model)
        message_id = f"msg_{uuid.uuid4().hex}"
        if body.stream:
            stream = _stream(generation, MessageStream(message_id, model,
                                                       generation.context_bound,
                                                       body.omit_thinking))
            # Anthropic pings while a long prompt is computed; so do we, as an event of
            # its own.
            return GenerationEventSource(generation, stream, ping=_ping)
        results = await to_the_end(
            request, generation, collect(generation.events(), generation.choices)
        )
        if results is None:
            return Response(status_code=CLIENT_CLOSED)
        return model_response(message_response(message_id, model, generation.context_bound,
                                               results[0], body.omit_thinking))

    def error_event(error: APIError) -> NamedEvent:
        return _sse(error.anthropic_body(request_id_of(request.scope)))

    return await respond_with_model(state.models, body.model, body.stream, respond,
                                    error_event, _ping)


def _ping() -> NamedEvent:
    return _sse(Ping())


@router.post("/messages/count_tokens")
async def count_tokens(body: TokenCountRequest, request: Request) -> TokenCount:
    state = server_state(request)
    async with state.models.use(body.model) as lease:
        prompts = await render(lease.model, generation_request(body))
    return TokenCount(input_tokens=len(prompts[0].tokens))
