"""OpenAI's Responses API onto the shared pipeline: `/v1/responses` (create, get, delete).

A thin adapter: input items (messages, function and custom tool calls and their outputs,
reasoning) become chat messages after the stored conversation a `previous_response_id`
names, the shared pipeline runs the `GenerationRequest`, and `ResponseBuilder` turns its
neutral events into output items and the documented event sequence. The same builder
makes the non-streaming response, so a streamed and a whole response cannot disagree;
the finished response and its conversation go to the response store when `store` is
true.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import TypeAdapter

from engine.api import SamplingKnobs
from engine.image_tokens import MARKER
from engine.json_schemas import strict_mode
from server.config import SamplingDefaults
from server.custom_tools import InputReader, custom_arguments, custom_function
from server.events import (
    ChoiceFinished,
    Event,
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallStarted,
)
from server.http.errors import APIError, params_renamed
from server.http.json_body import JSONRoute
from server.http.loading import respond_with_model
from server.http.model_response import model_response
from server.http.openapi import error_responses, event_stream
from server.http.streaming import CLIENT_CLOSED, GenerationEventSource, NamedEvent, to_the_end
from server.model_registry import Lease
from server.openai.adapter import effort_kwargs
from server.openai.formats import chat_logprobs
from server.openai.protocol import ErrorResponse
from server.pipeline import GenerationRun, first_that_fits, render, start
from server.request import (
    TEXT,
    AllowedTools,
    FunctionTool,
    GenerationRequest,
    JsonObjectOutput,
    JsonSchemaOutput,
    NamedFunction,
    OutputFormat,
    TemplateMessage,
    template_arguments,
    template_call,
    turn_text,
    unset_knobs,
)
from server.request import ToolChoice as GenerationToolChoice
from server.responses.protocol import (
    TEXT_PART_TYPES,
    AllowedToolsChoice,
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    Content,
    CustomChoice,
    CustomInputDeltaEvent,
    CustomInputDoneEvent,
    CustomTool,
    CustomToolCallItem,
    CustomToolCallOutputItem,
    DeletedResponse,
    ErrorEvent,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    IncompleteDetails,
    InputItem,
    InputItemList,
    InputTokenCount,
    InputTokensDetails,
    ItemEvent,
    ItemReference,
    ItemStatus,
    JsonObjectFormat,
    JsonSchemaFormat,
    MessageItem,
    OutputCustomToolCall,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    PartEvent,
    ReasoningItem,
    ReasoningSettings,
    ReasoningText,
    ResponseError,
    ResponseEvent,
    ResponsesRequest,
    ResponseUsage,
    StreamEvent,
    TextDeltaEvent,
    TextDoneEvent,
    content_images,
    joined_text,
)
from server.responses.protocol import FunctionTool as ResponsesFunctionTool
from server.responses.protocol import Response as ResponseObject
from server.responses.store import StoredResponse
from server.state import ServerState, server_state

# -- request ------------------------------------------------------------------------------


# A chat message's images, in conversations this adapter builds and stores (never shown to
# the template).
IMAGES = "images"
# Where an image was in a stored message's text before `MARKER` became a pair.
FORMER_MARKER = "\ufffc"


def with_current_markers(message: TemplateMessage) -> TemplateMessage:
    """A stored message with its images' markers as this server writes them: a SQLite
    store keeps conversations written before the marker became a pair (server/images.py),
    whose images the lone U+FFFC marked."""
    content = message.get("content")
    if not message.get(IMAGES) or not isinstance(content, str) or MARKER in content:
        return message
    return {**message, "content": content.replace(FORMER_MARKER, MARKER)}


def input_messages(body: ResponsesRequest, history: list[TemplateMessage]) -> list[TemplateMessage]:
    """The new input as chat messages, after `history` (a stored conversation). A run of
    assistant-side items (reasoning, an assistant message, function calls) is one
    assistant turn, as a chat template sees it, its messages' texts a line apart."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[TemplateMessage] = []

    def assistant_turn() -> TemplateMessage:
        if not messages or messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant", "content": ""})
        return messages[-1]

    for item in body.input:
        if isinstance(item, MessageItem) and item.role != "assistant":
            messages.append(_with_images(item.role, item.content))
        elif isinstance(item, MessageItem):  # text only (MessageItem refuses images)
            turn = assistant_turn()
            turn["content"] = turn_text((turn["content"], joined_text(item.content)))
        elif isinstance(item, ReasoningItem):
            turn = assistant_turn()
            turn["reasoning_content"] = turn.get("reasoning_content", "") + item.text
        elif isinstance(item, FunctionCallItem | CustomToolCallItem):
            assistant_turn().setdefault("tool_calls", []).append(_template_call(item))
        elif isinstance(item, CustomToolCallOutputItem):
            messages.append({**_with_images("tool", item.output), "tool_call_id": item.call_id})
        elif isinstance(item, FunctionCallOutputItem):
            result = _with_images("tool", item.output)
            call_id = item.call_id or _answered_call(history + messages, item)
            if call_id is not None:
                result["tool_call_id"] = call_id
            if item.name is not None:
                result["name"] = item.name
            messages.append(result)
    return messages


def _with_images(role: str, content: Content) -> TemplateMessage:
    """A chat message of `content` with the URLs of its images (a user's picture, a tool's
    screenshot), kept with it so a stored conversation keeps them, and each one loaded
    where its marker is."""
    message: TemplateMessage = {"role": role, "content": joined_text(content)}
    if images := content_images(content):
        message[IMAGES] = images
    return message


def _template_call(call: FunctionCallItem | CustomToolCallItem | OutputFunctionCall
                   | OutputCustomToolCall) -> dict[str, Any]:
    """A call, sent back or made here, as a chat template's tool call: a custom tool's
    input as the one string of the function the model is shown (`custom_function`)."""
    arguments = (call.arguments if isinstance(call, FunctionCallItem | OutputFunctionCall)
                 else custom_arguments(call.input))
    return template_call(call.call_id, call.name, template_arguments(arguments))


def function_tool(tool: ResponsesFunctionTool) -> FunctionTool:
    """A function tool; where `strict` is unsaid, strict by default as OpenAI's Responses
    API has it (Chat Completions' default is the opposite): its parameters normalized to
    strict mode (every listed property required, objects closed) and its calls bound to
    them, whatever the tool choice. `strict: false` opts out."""
    if tool.strict is not None:
        return FunctionTool(tool.name, tool.description, tool.parameters, tool.strict)
    return FunctionTool(tool.name, tool.description, echoed_tool(tool).parameters,
                        strict_by_default=True)


def echoed_tool(tool: ResponsesFunctionTool | CustomTool) -> ResponsesFunctionTool | CustomTool:
    """A tool as it runs, and as the response object lists it: a function whose `strict`
    was unsaid shows the strict mode it ran under, as OpenAI's response does."""
    if not isinstance(tool, ResponsesFunctionTool) or tool.strict is not None:
        return tool
    parameters = None if tool.parameters is None else strict_mode(tool.parameters)
    return tool.model_copy(update={"strict": True, "parameters": parameters})


def _answered_call(messages: list[TemplateMessage], item: FunctionCallOutputItem) -> str | None:
    """The call an output without `call_id` answers: the latest earlier call whose id is
    the output's `id`, else the latest unanswered one of its `name`; None: no such call,
    and the output stays a plain tool result."""
    answered = {message.get("tool_call_id") for message in messages if message["role"] == "tool"}
    calls = [call for message in reversed(messages) if message["role"] == "assistant"
             for call in reversed(message.get("tool_calls") or ())]
    by_id = next((call for call in calls if item.id is not None and call["id"] == item.id), None)
    by_name = next((call for call in calls if call["function"]["name"] == item.name
                    and call["id"] not in answered), None)
    call = by_id or by_name
    return None if call is None else call["id"]


def generation_request(
    body: ResponsesRequest, conversation: list[TemplateMessage]
) -> GenerationRequest:
    """`conversation`: the stored one plus the new input. Instructions are the request's
    own: OpenAI does not carry them over from a previous response."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    return GenerationRequest(
        messages=tuple({key: value for key, value in message.items() if key != IMAGES}
                       for message in system + conversation),
        images=tuple(url for message in conversation for url in message.get(IMAGES, ())),
        tools=tuple(function_tool(tool) for tool in body.function_tools)
        + tuple(custom_function(tool.name, tool.description, tool.grammar)
                for tool in body.custom_tools),
        tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        output=_output_format(body),
        sampling=SamplingKnobs(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            speculation=body.speculation,
        ),
        unset_sampling=unset_knobs(body),
        max_tokens=body.max_output_tokens,
        logprobs=body.logprobs,
        fit_context=True,
        stream=body.stream,
        include_usage=True,
        chat_template_kwargs=effort_kwargs(body.reasoning.effort if body.reasoning else None),
    )


def _tool_choice(choice: Any) -> GenerationToolChoice:
    if isinstance(choice, FunctionChoice | CustomChoice):
        return NamedFunction(choice.name)
    if isinstance(choice, AllowedToolsChoice):
        return AllowedTools(choice.mode, tuple(tool.name for tool in choice.tools))
    return choice or "auto"


def _output_format(body: ResponsesRequest) -> OutputFormat:
    fmt = body.text.format if body.text is not None else None
    if isinstance(fmt, JsonSchemaFormat):
        return JsonSchemaOutput(fmt.name, fmt.schema_, bool(fmt.strict))
    return JsonObjectOutput() if isinstance(fmt, JsonObjectFormat) else TEXT


# -- response -----------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


TextItem = OutputMessage | OutputReasoning


class ResponseBuilder:
    """Neutral events into output items and the Responses stream events, numbered.

    Items are added one at a time, in order; an item is done when the next kind of
    content begins or the generation finishes. A message or reasoning item has one part,
    whose text grows with each delta."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self._sequence = 0
        self._item: OutputItem | None = None  # the open one
        self._custom = {tool.name for tool in response.tools if isinstance(tool, CustomTool)}
        self._input = InputReader()  # an open custom call's input, out of its arguments
        self._unsent_logprobs: list[Any] = []  # a held-back token's, until its text is out

    def opening(self) -> list[StreamEvent]:
        return [self._lifecycle("response.created"), self._lifecycle("response.in_progress")]

    def event(self, event: Event) -> list[StreamEvent]:
        if isinstance(event, TextDelta):
            return self._text(OutputMessage, event.text, chat_logprobs(event.tokens).content)
        if isinstance(event, ReasoningDelta):
            return self._text(OutputReasoning, event.text)
        if isinstance(event, ToolCallStarted):
            closed = self._close()  # a custom call before this one reads its arguments
            if event.name in self._custom:
                self._input = InputReader()
                call = OutputCustomToolCall(id=_new_id("ctc"), call_id=event.id,
                                            name=event.name, input="", status="in_progress")
            else:
                call = OutputFunctionCall(id=_new_id("fc"), call_id=event.id, name=event.name,
                                          arguments="", status="in_progress")
            return closed + self._add(call)
        if isinstance(event, ToolCallArguments):
            if isinstance(self._item, OutputCustomToolCall):
                return self._custom_input(self._input.feed(event.fragment))
            if not event.fragment:
                return []
            self._item.arguments += event.fragment
            return [self._number(ArgumentsDeltaEvent(
                item_id=self._item.id, output_index=self._index, delta=event.fragment))]
        return self._finish(event)

    def failed(self, error: APIError) -> list[StreamEvent]:
        self.response.status = "failed"
        self.response.error = ResponseError(code=error.code or "server_error",
                                            message=error.message)
        return [
            self._number(ErrorEvent(code=error.code, message=error.message, param=error.param)),
            self._lifecycle("response.failed"),
        ]

    @property
    def _index(self) -> int:
        return len(self.response.output) - 1

    def _text(self, kind: type[TextItem], text: str, logprobs: list[Any] | None = None
              ) -> list[StreamEvent]:
        """`logprobs`: the answer tokens' behind `text`, where they were asked for (a
        token's text may come in a later delta than its logprob, held back)."""
        if not text and not logprobs:
            return []
        events = [] if isinstance(self._item, kind) else self._open(kind)
        part = self._item.content[0]
        part.text += text
        if isinstance(part, OutputText):
            part.logprobs += logprobs or []
            self._unsent_logprobs += logprobs or []
            if not text:
                return events  # the delta with its text carries them
            unsent, self._unsent_logprobs = self._unsent_logprobs, []
            return [*events, self._number(TextDeltaEvent(
                type="response.output_text.delta", item_id=self._item.id,
                output_index=self._index, delta=text, logprobs=unsent))]
        return [*events, self._number(TextDeltaEvent(
            type="response.reasoning_text.delta", item_id=self._item.id,
            output_index=self._index, delta=text))]

    def _custom_input(self, text: str) -> list[StreamEvent]:
        """The open custom call's input, as much more of it as its arguments gave."""
        if not text:
            return []
        self._item.input += text
        return [self._number(CustomInputDeltaEvent(item_id=self._item.id,
                                                   output_index=self._index, delta=text))]

    def _open(self, kind: type[TextItem]) -> list[StreamEvent]:
        """Close the open item and open a `kind` item of one empty part."""
        prefix = "msg" if kind is OutputMessage else "rs"
        part = OutputText(text="") if kind is OutputMessage else ReasoningText(text="")
        events = self._close() + self._add(kind(id=_new_id(prefix), status="in_progress",
                                                content=[]))
        self._item.content.append(part)
        return [*events, self._part_event("response.content_part.added", self._item)]

    def _add(self, item: OutputItem) -> list[StreamEvent]:
        self.response.output.append(item)
        self._item = item
        added = ItemEvent(type="response.output_item.added", output_index=self._index,
                          item=item.model_copy(deep=True))
        return [self._number(added)]

    def _close(self, status: ItemStatus = "completed") -> list[StreamEvent]:
        """Finish the open item: `incomplete` when the reply ran out of tokens in it (a
        function call's arguments then stop mid-JSON), as OpenAI marks it."""
        item = self._item
        if item is None:
            return []
        if isinstance(item, OutputFunctionCall):
            events = [self._number(ArgumentsDoneEvent(
                item_id=item.id, output_index=self._index, name=item.name,
                arguments=item.arguments))]
        elif isinstance(item, OutputCustomToolCall):
            events = [*self._custom_input(self._input.finish()), self._number(
                CustomInputDoneEvent(item_id=item.id, output_index=self._index,
                                     input=item.input))]
        else:
            # Logprobs still unsent, of tokens whose text an earlier delta carried (the
            # engine puts the text of tokens ready together on the first): a delta of no
            # text, so the deltas' logprobs are the done event's.
            events = [self._number(TextDeltaEvent(
                type="response.output_text.delta", item_id=item.id, output_index=self._index,
                delta="", logprobs=self._unsent_logprobs))] if self._unsent_logprobs else []
            events += [
                self._number(TextDoneEvent(
                    type=f"response.{_part_kind(item)}.done", item_id=item.id,
                    output_index=self._index, text=item.content[0].text, **_logprobs(item))),
                self._part_event("response.content_part.done", item),
            ]
        item.status = status
        self._item = None
        self._unsent_logprobs = []
        return [*events, self._number(ItemEvent(type="response.output_item.done",
                                                output_index=self._index, item=item))]

    def _finish(self, finished: ChoiceFinished) -> list[StreamEvent]:
        # A reply of nothing (the model ended at once) is still an assistant message, as
        # OpenAI's is: a client reads a response of no items as one still to come.
        events = [] if self.response.output else self._open(OutputMessage)
        events += self._close("incomplete" if finished.reason == "length" else "completed")
        usage = finished.usage
        self.response.usage = ResponseUsage(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(
                cached_tokens=usage.cached_tokens,
                cache_write_tokens=usage.prompt_tokens - usage.cached_tokens,
            ),
            output_tokens=usage.completion_tokens,
            output_tokens_details=OutputTokensDetails(
                reasoning_tokens=usage.reasoning_tokens or 0),
            total_tokens=usage.total_tokens,
        )
        if finished.reason == "length":
            self.response.status = "incomplete"
            self.response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
            return events + [self._lifecycle("response.incomplete")]
        self.response.status = "completed"
        return events + [self._lifecycle("response.completed")]

    def _lifecycle(self, kind: str) -> StreamEvent:
        return self._number(ResponseEvent(type=kind, response=self.response.model_copy(deep=True)))

    def _part_event(self, kind: str, item: TextItem) -> StreamEvent:
        return self._number(PartEvent(type=kind, item_id=item.id, output_index=self._index,
                                      part=item.content[0].model_copy()))

    def _number(self, event: StreamEvent) -> StreamEvent:
        event.sequence_number = self._sequence
        self._sequence += 1
        return event


def _part_kind(item: TextItem) -> str:
    return "output_text" if isinstance(item, OutputMessage) else "reasoning_text"


def _logprobs(item: TextItem) -> dict[str, list]:
    """Answer text events carry their part's logprobs (none unless asked for); reasoning
    events none."""
    return {"logprobs": item.content[0].logprobs} if isinstance(item, OutputMessage) else {}


def assistant_message(response: ResponseObject) -> TemplateMessage:
    """The response's output as the assistant turn a follow-up continues after."""
    message: TemplateMessage = {"role": "assistant", "content": turn_text(
        "".join(part.text for part in item.content)
        for item in response.output if isinstance(item, OutputMessage))}
    for item in response.output:
        if isinstance(item, OutputReasoning):
            message["reasoning_content"] = item.content[0].text
        elif isinstance(item, OutputFunctionCall | OutputCustomToolCall):
            message.setdefault("tool_calls", []).append(_template_call(item))
    return message


# -- routes -------------------------------------------------------------------------------

router = APIRouter(prefix="/v1", responses=error_responses(ErrorResponse),
                   route_class=JSONRoute)


# The pipeline's refusals name Chat Completions' parameters; these are the same ones here.
RESPONSES_PARAMS = {"messages": "input", "response_format": "text.format",
                    "max_tokens": "max_output_tokens"}


@router.post("/responses", responses={
    200: {"model": ResponseObject, "content": event_stream(StreamEvent, ErrorResponse)}})
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    state = server_state(request)
    body, conversation = await _conversation(state, body)

    async def respond(lease: Lease) -> Response:
        with params_renamed(RESPONSES_PARAMS):
            shorter = None
            if body.truncation == "auto":
                async def shorter() -> GenerationRequest:
                    return generation_request(body, await _truncated(lease, body, conversation))
            generation = await start(request, state, lease,
                                     generation_request(body, conversation), shorter)
        model = state.models.name_for(lease.model, body.model)
        return await _respond(request, state, body, conversation, generation, model,
                              lease.model.spec.sampling)

    return await respond_with_model(
        state.models, body.model, body.stream, respond,
        lambda error: _sse(ErrorEvent(code=error.code, message=error.message,
                                      param=error.param)))


@router.post("/responses/input_tokens")
async def count_input_tokens(body: ResponsesRequest, request: Request) -> InputTokenCount:
    """The tokens of the prompt a response request makes (its instructions, tools, input
    items and the conversation of the response it goes on from), rendered as
    /v1/responses renders it. Fields that shape only the output are taken and change
    nothing."""
    state = server_state(request)
    body, conversation = await _conversation(state, body)
    async with state.models.use(body.model) as lease:
        prompts = await render(lease.model, generation_request(body, conversation))
    return InputTokenCount(input_tokens=len(prompts[0].tokens))


async def _conversation(state: ServerState, body: ResponsesRequest
                        ) -> tuple[ResponsesRequest, list[TemplateMessage]]:
    """`body` with its item references resolved, and the conversation it asks about: the
    stored one of its previous response, then its own input."""
    body = await _referenced(state, body)
    history: list[TemplateMessage] = []
    if body.previous_response_id is not None:
        previous = await _stored(state, body.previous_response_id, "previous_response_id")
        history = [with_current_markers(message) for message in previous.conversation]
    return body, history + input_messages(body, history)


async def _truncated(lease: Lease, body: ResponsesRequest,
                     conversation: list[TemplateMessage]) -> list[TemplateMessage]:
    """truncation "auto", for a conversation too long for the context window: it without
    as few of its oldest items as leave its prompt room to answer. Whole turns go first,
    from a user message to the next; then, within the last turn (an agent's task and its
    tool calls), its oldest exchanges, an assistant message with the tool results after
    it, so no result loses its call and the task stays. The system messages before the
    first turn always stay; if even the task and its latest exchange do not fit, the
    request is refused as too long. The stored conversation keeps every item."""
    head = 0
    while head < len(conversation) and conversation[head]["role"] == "system":
        head += 1
    users = [i for i in range(head, len(conversation)) if conversation[i]["role"] == "user"]
    if not users:
        return conversation
    task = users[-1]
    exchanges = [i for i in range(task + 1, len(conversation))
                 if conversation[i]["role"] == "assistant"][1:]
    # Each shorter than the one before: from a later turn, then the task from a later
    # exchange.
    shorter = [conversation[:head] + conversation[start:] for start in users[1:]]
    shorter += [conversation[:head] + [conversation[task]] + conversation[start:]
                for start in exchanges]
    fitting = await first_that_fits(lease, shorter,
                                    lambda messages: generation_request(body, messages))
    return conversation if fitting is None else fitting


def _sampled_at(asked: float | None, default: float | None) -> float:
    """A knob's value as a response echoes it, the one sampled at (as OpenAI's, which says
    1.0 for one left out): the request's, else the model's default, else OpenAI's 1.0."""
    return next(value for value in (asked, default, 1.0) if value is not None)


async def _respond(request: Request, state: ServerState, body: ResponsesRequest,
                   conversation: list[TemplateMessage], generation: GenerationRun, model: str,
                   defaults: SamplingDefaults) -> Response:
    builder = ResponseBuilder(ResponseObject(
        id=_new_id("resp"), status="in_progress", model=model,
        instructions=body.instructions, previous_response_id=body.previous_response_id,
        tools=[echoed_tool(tool) for tool in body.function_tools + body.custom_tools],
        tool_choice=body.tool_choice or "auto",
        parallel_tool_calls=body.parallel_tool_calls is not False,
        # What was sent, with plain text for a format left out, as OpenAI echoes it.
        text={"format": {"type": "text"}}
        | (body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {}),
        max_output_tokens=body.max_output_tokens,
        temperature=_sampled_at(body.temperature, defaults.temperature),
        top_p=_sampled_at(body.top_p, defaults.top_p), store=body.store, metadata=body.metadata or {},
        prompt_cache_key=body.prompt_cache_key,
        prompt_cache_retention=body.prompt_cache_retention, user=body.user,
        top_logprobs=body.top_logprobs,
        safety_identifier=body.safety_identifier, truncation=body.truncation or "disabled",
        reasoning=ReasoningSettings(**body.reasoning.model_dump()) if body.reasoning else
        ReasoningSettings(),
        max_tool_calls=body.max_tool_calls,
    ))
    save = ((lambda: _save(state, builder.response, conversation, input_items(body)))
            if body.store else None)
    if body.stream:
        return GenerationEventSource(generation, _stream(generation, builder, save))
    done = await to_the_end(request, generation, _run(generation, builder))
    if done is None:
        return Response(status_code=CLIENT_CLOSED)
    if save is not None:
        await save()
    return model_response(builder.response)


async def _run(generation: GenerationRun, builder: ResponseBuilder) -> bool:
    async for event in generation.events():
        builder.event(event)
    return True


async def _stream(
    generation: GenerationRun, builder: ResponseBuilder, save: Any
) -> AsyncIterator[list[NamedEvent]]:
    """Each list goes out in one write: what one generation event becomes."""
    try:
        yield [_sse(out) for out in builder.opening()]
        async for event in generation.events():
            events = builder.event(event)
            if save is not None and builder.response.status in ("completed", "incomplete"):
                # Before the terminal event: a client may close the stream once it has it
                # (the SDKs' `break`), and the rest of this generator then never runs.
                await save()
                save = None
            yield [_sse(out) for out in events]
    except APIError as error:
        # The status line is sent already: the failure travels as events.
        yield [_sse(out) for out in builder.failed(error)]


def _sse(event: StreamEvent) -> NamedEvent:
    return NamedEvent(event.type, event.model_dump_json())


async def _save(state: ServerState, response: ResponseObject,
                conversation: list[TemplateMessage], items: list[dict[str, Any]]) -> None:
    entry = StoredResponse(response.model_dump(mode="json"),
                           conversation + [assistant_message(response)], items)
    await asyncio.to_thread(state.responses.put, response.id, entry)


# The id an input item the client sent without one is listed under, by type.
ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                    "reasoning": "rs", "custom_tool_call": "ctc",
                    "custom_tool_call_output": "ctco"}


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as the items OpenAI lists for a response: a string is one user
    message; every item has an id (made where the client sent none) and a status, and a
    message's text is in content parts of the kind its role is listed with."""
    if isinstance(body.input, str):
        items = [{"type": "message", "role": "user", "content": body.input}]
    else:
        items = [item.model_dump(mode="json", by_alias=True, exclude_none=True)
                 for item in body.input]
    for item in items:
        item.setdefault("id", _new_id(ITEM_ID_PREFIXES[item["type"]]))
        item.setdefault("status", "completed")
        if item["type"] == "message":
            content = item["content"]
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            item["content"] = [_listed_part(part, item["role"]) for part in parts]
    return items


def _listed_part(part: dict[str, Any], role: str) -> dict[str, Any]:
    """A message's text part as OpenAI lists it: an assistant's is output text with its
    annotations (none here), which the SDK's ResponseOutputMessage requires; anyone
    else's is input text. Other parts (images, files, refusals) stay as sent."""
    if part["type"] not in TEXT_PART_TYPES:
        return part
    if role == "assistant":
        return {"type": "output_text", "text": part["text"], "annotations": []}
    return {"type": "input_text", "text": part["text"]}


INPUT_ITEM = TypeAdapter(InputItem)


async def _referenced(state: ServerState, body: ResponsesRequest) -> ResponsesRequest:
    """`body` with each `item_reference` replaced by the stored item it names (an item
    no stored response has is a 404), so the request reads as if the client had sent the
    item itself, and is stored so."""
    if isinstance(body.input, str) or not any(isinstance(item, ItemReference)
                                              for item in body.input):
        return body
    items = []
    for index, item in enumerate(body.input):
        if isinstance(item, ItemReference):
            stored = await asyncio.to_thread(state.responses.item, item.id)
            if stored is None:
                raise APIError(404, f"Item with id '{item.id}' not found.",
                               code="item_not_found", param=f"input.{index}.id")
            item = INPUT_ITEM.validate_python(stored)
        items.append(item)
    return body.model_copy(update={"input": items})


async def _stored(state: ServerState, response_id: str, param: str | None) -> StoredResponse:
    """The stored response `response_id`: a 404 where the path names it, and OpenAI's 400
    where a request's previous_response_id does (Codex's proxies resend the whole
    conversation on that code)."""
    stored = await asyncio.to_thread(state.responses.get, response_id)
    if stored is None and param == "previous_response_id":
        raise APIError(400, f"Previous response with id '{response_id}' not found.",
                       code="previous_response_not_found", param=param)
    if stored is None:
        raise APIError(404, f"Response with id '{response_id}' not found.",
                       code="response_not_found", param=param)
    return stored


@router.get("/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> ResponseObject:
    stored = await _stored(server_state(request), response_id, None)
    return ResponseObject.model_validate(stored.response)


@router.get("/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str, request: Request, after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20, order: Literal["asc", "desc"] = "desc",
    include: Annotated[list[str] | None, Query()] = None,
) -> InputItemList:
    """The input items the request that made a stored response sent, a page at a time
    (`after` an item's id; newest first unless `order=asc`). `include` names fields
    OpenAI can add to items; these items have nothing to add."""
    items = (await _stored(server_state(request), response_id, None)).input_items
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(400, f"No input item with id '{after}' in response '{response_id}'.",
                           code="invalid_request", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return InputItemList(data=page, first_id=page[0]["id"] if page else None,
                         last_id=page[-1]["id"] if page else None,
                         has_more=len(items) > limit)


@router.post("/responses/{response_id}/cancel", include_in_schema=False)
async def cancel_response(response_id: str, request: Request) -> ResponseObject:
    """OpenAI cancels only background responses, which this server does not run: every
    stored response is already complete. A refusal in the API's words where a client
    calls it, not an operation the schema offers."""
    await _stored(server_state(request), response_id, None)
    raise APIError(400, f"Response '{response_id}' is not a background response: only "
                        "background responses can be cancelled, and this server runs none.",
                   code="invalid_request")


@router.delete("/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> DeletedResponse:
    state = server_state(request)
    if not await asyncio.to_thread(state.responses.delete, response_id):
        raise APIError(404, f"Response with id '{response_id}' not found.",
                       code="response_not_found")
    return DeletedResponse(id=response_id)
