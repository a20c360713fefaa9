"""Pydantic models of OpenAI's Responses API (`/v1/responses`).

Requests validate declaratively like the chat models: strict types, unknown fields
ignored (what OpenAI adds next must not fail a request). `input_image` parts
with an `image_url` are read by vision models (server/images.py), `input_file` parts of
text read in as text (server/documents.py); what no model here reads (PDFs, audio) is
refused with a 400 that names it. Hosted tools (web search, file search, ...) are not
shown to the model: nobody here runs them.
Responses, output items and stream events mirror what the official `openai` SDK parses.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union, get_args

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from engine.api import SpeculationMode
from engine.image_tokens import MARKER
from server.documents import ReadInText, document, text_of_data_url
from server.schema import (
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
    FormatName,
    Metadata,
    ObjectSchema,
    RefusalPart,
    RequestModel,
    ResponseModel,
    check_tool_names,
    now,
    shaped_union,
    tool_choice_union,
)

# -- input items ---------------------------------------------------------------------------


# The content parts read as text: OpenAI's input text, and the kinds clients send back
# from output and reasoning items.
TextPartType = Literal["input_text", "output_text", "text", "summary_text", "reasoning_text"]
TEXT_PART_TYPES = get_args(TextPartType)


class InputText(RequestModel):
    type: TextPartType
    text: str


class InputImage(RequestModel):
    type: Literal["input_image"]
    # A data: URL, or http(s) from the hosts the server allows (server/images.py).
    image_url: str | None = None
    file_id: str | None = None  # no Files API here: refused
    # The processor decides the resolution; Codex sends "original" for full resolution.
    detail: Literal["auto", "low", "high", "original"] | None = None

    @model_validator(mode="after")
    def _has_url(self) -> InputImage:
        if self.image_url is None:
            raise ValueError("input_image needs an image_url (a data: URL); this server "
                             "has no Files API for file_id")
        return self


class InputFile(ReadInText):
    """A file, read in as text where its `file_data` is a data: URL of a text/* file
    (server/documents.py); a PDF, a `file_id` or a `file_url` is a 400."""

    type: Literal["input_file"]
    file_data: str | None = None
    file_id: str | None = None
    file_url: str | None = None
    filename: str | None = None

    def read_in(self) -> str:
        if self.file_data is None:
            raise ValueError("input_file needs file_data (a data: URL of a text file); this "
                             "server fetches no file_url and has no Files API for file_id")
        return document(text_of_data_url(self.file_data), self.filename)


class UnsupportedPart(RequestModel):
    type: str

    @model_validator(mode="after")
    def _refuse(self) -> UnsupportedPart:
        if self.type == "input_audio":
            raise ValueError("input_audio parts are not supported: send their text")
        raise ValueError(f"content parts of type {self.type!r} are not supported")


def _text_part_kind(value: Any) -> str | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        return None
    if value["type"] in ("input_image", "input_file", "refusal"):
        return value["type"]
    return "text" if value["type"] in TEXT_PART_TYPES else "unsupported"


TextPart = Annotated[
    Annotated[InputText, Tag("text")] | Annotated[RefusalPart, Tag("refusal")]
    | Annotated[InputImage, Tag("input_image")] | Annotated[InputFile, Tag("input_file")]
    | Annotated[UnsupportedPart, Tag("unsupported")],
    Discriminator(_text_part_kind, custom_error_type="invalid_type",
                  custom_error_message="must be a content part object with a type"),
]


def _str_or_list(value: Any) -> str | None:
    return "str" if isinstance(value, str) else "list" if isinstance(value, list) else None


Content = shaped_union(
    _str_or_list, "a string or a list of content parts", str=str, list=list[TextPart]
)


def joined_text(content: Content) -> str:
    """The content's text, its parts a line apart as Chat Completions' are (and vLLM's
    Responses API joins them), so words at the seams stay apart; an image part is its
    marker there."""
    if isinstance(content, str):
        return content
    return "\n".join(MARKER if isinstance(part, InputImage) else part.text for part in content)


def content_images(content: Content) -> list[str]:
    """The URLs of the content's image parts, in order."""
    if isinstance(content, str):
        return []
    return [part.image_url for part in content if isinstance(part, InputImage)]


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content
    id: str | None = None
    status: str | None = None

    @model_validator(mode="after")
    def _assistant_has_no_images(self) -> MessageItem:
        # A model's own turn is the text it wrote: refused as Chat Completions and
        # Messages refuse an image in an assistant message.
        if self.role == "assistant" and content_images(self.content):
            raise ValueError("input_image parts belong in user messages and tool outputs, "
                             "not in assistant messages")
        return self


class CallItem(RequestModel):
    """A tool call the model made, sent back."""

    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    id: str | None = None
    status: str | None = None


class FunctionCallItem(CallItem):
    type: Literal["function_call"]
    arguments: str


class FunctionCallOutputItem(RequestModel):
    """A call's result. Codex also sends results of its own built-in functions with no
    `call_id`, only an `id` and the function's `name` (and a `namespace`): the adapter
    matches those to an earlier call, or keeps them as a plain tool result."""

    type: Literal["function_call_output"]
    call_id: str | None = Field(None, min_length=1)
    output: Content
    id: str | None = None
    name: str | None = None
    status: str | None = None

    @model_validator(mode="after")
    def _names_its_call(self) -> FunctionCallOutputItem:
        if self.call_id is None and self.id is None and self.name is None:
            raise ValueError("function_call_output needs the call_id of the call it answers")
        return self


class CustomToolCallItem(CallItem):
    """A call of a freeform `custom` tool: its input is the text the model wrote."""

    type: Literal["custom_tool_call"]
    input: str


class CustomToolCallOutputItem(RequestModel):
    type: Literal["custom_tool_call_output"]
    call_id: str = Field(min_length=1)
    output: Content
    id: str | None = None


class ReasoningItem(RequestModel):
    """Earlier reasoning sent back. A local model can read `content` (its own text);
    `encrypted_content` is OpenAI's and stays opaque."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[InputText] = Field(default_factory=list)
    content: list[InputText] | None = None
    encrypted_content: str | None = None

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or self.summary)


class ItemReference(RequestModel):
    """An item of a stored response, its input's or its output's, by id: the adapter puts
    that item in its place before anything reads the input."""

    type: Literal["item_reference"] | None = None
    id: str = Field(min_length=1)


class UnsupportedItem(RequestModel):
    type: str

    @model_validator(mode="after")
    def _refuse(self) -> UnsupportedItem:
        raise ValueError(f"input items of type {self.type!r} are not supported")


# The least max_output_tokens OpenAI takes: a smaller one is its 400, so a client that
# works here works there.
MIN_OUTPUT_TOKENS = 16

# What `include` names for logprobs with the answer's text.
LOGPROBS_INCLUDE = "message.output_text.logprobs"

ITEM_TYPES = {
    "message": MessageItem, "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem,
    "custom_tool_call": CustomToolCallItem, "custom_tool_call_output": CustomToolCallOutputItem,
    "item_reference": ItemReference,
}


def _item_kind(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    kind = value.get("type")
    if kind is None:  # EasyInputMessage and ItemReference may omit their type
        kind = "item_reference" if "id" in value and "role" not in value else "message"
    if not isinstance(kind, str):
        return None
    return kind if kind in ITEM_TYPES else "unsupported"


InputItem = Annotated[
    Union[  # noqa: UP007
        tuple(Annotated[model, Tag(tag)] for tag, model in ITEM_TYPES.items())
        + (Annotated[UnsupportedItem, Tag("unsupported")],)
    ],
    Discriminator(_item_kind, custom_error_type="invalid_type",
                  custom_error_message="must be an input item object"),
]
Input = shaped_union(
    _str_or_list, "a string or a list of input items",
    str=str, list=list[InputItem],
)


# -- tools, tool choice, output format ----------------------------------------------------


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: ObjectSchema | None = None
    strict: bool | None = None


class CustomToolFormat(RequestModel):
    """What a custom tool's input is: free text, or text in a grammar (Lark or a regular
    expression), which the model is shown."""

    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None

    @model_validator(mode="after")
    def _grammar_given(self) -> CustomToolFormat:
        if self.type == "grammar" and (self.syntax is None or not self.definition):
            raise ValueError("a grammar format needs its syntax and definition")
        return self


class CustomTool(RequestModel):
    """A tool whose input is freeform text (Codex's apply_patch for GPT-5 models)."""

    type: Literal["custom"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    format: CustomToolFormat | None = None

    @property
    def grammar(self) -> tuple[Literal["lark", "regex"], str] | None:
        """Its input's grammar (syntax, definition); None: free text."""
        fmt = self.format
        if fmt is None or fmt.type != "grammar":
            return None
        return fmt.syntax, fmt.definition


class HostedTool(RequestModel):
    """A tool OpenAI runs (web_search, image_generation, ...). Codex sends several by
    default; the served model is not shown them, as llama.cpp's server does, so it never
    calls what nobody here can run."""

    type: str


ToolDefinition = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[CustomTool, Tag("custom")]
    | Annotated[HostedTool, Tag("hosted")],
    Discriminator(
        lambda value: (None if not isinstance(value, dict)
                       else value["type"] if value.get("type") in ("function", "custom")
                       else "hosted"),
        custom_error_type="invalid_type", custom_error_message="must be a tool object",
    ),
]


class FunctionChoice(RequestModel):
    type: Literal["function"]
    name: str


class CustomChoice(RequestModel):
    type: Literal["custom"]
    name: str


class AllowedToolsChoice(RequestModel):
    """Only these of the tools may be called; the model still sees them all."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[Annotated[FunctionChoice | CustomChoice, Field(discriminator="type")]] = Field(
        min_length=1)


ToolChoice = tool_choice_union(function=FunctionChoice, custom=CustomChoice,
                               allowed_tools=AllowedToolsChoice)


class TextFormat(RequestModel):
    type: Literal["text"]


class JsonObjectFormat(RequestModel):
    type: Literal["json_object"]


class JsonSchemaFormat(RequestModel):
    type: Literal["json_schema"]
    name: FormatName
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


Format = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class TextConfig(RequestModel):
    format: Format | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(RequestModel):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(RequestModel):
    model: str | None = None
    # Optional, as in OpenAI's API: instructions alone, or a stored response to go on from.
    input: Input = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: OpenAI's default (true for free choice)
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=MIN_OUTPUT_TOKENS)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    # Each answer token's logprob comes with this many likeliest alternatives; asked for
    # by it or by include's "message.output_text.logprobs".
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    include: list[str] | None = None  # what else OpenAI returns; logprobs here
    stream: bool = False
    store: bool = True
    metadata: Metadata | None = None
    user: str | None = None
    safety_identifier: str | None = None
    # One tier serves every request here; whichever is asked for, the response says
    # "default", the tier that served it, as OpenAI's does.
    service_tier: str | None = None
    # Bounds calls of hosted tools, which nobody here runs: echoed, otherwise moot.
    max_tool_calls: int | None = None
    # Codex sends one per conversation. A radix cache finds a shared prefix by itself,
    # so the key changes nothing here; it is echoed back as OpenAI does.
    prompt_cache_key: str | None = None
    # How long OpenAI keeps a cached prefix; the radix cache keeps it while it has room.
    # Echoed, as the key is.
    prompt_cache_retention: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # radix-mlx's: speculative decoding for this request (none: the server's mode).
    speculation: SpeculationMode | None = None
    background: bool = False
    conversation: Any = None
    # A prompt stored on OpenAI's platform, by id, with its variables: none is stored
    # here, and answered without it the reply would lack the caller's instructions.
    prompt: Any = None

    @property
    def logprobs(self) -> int | None:
        """The alternatives each answer token's logprob comes with (None: no logprobs)."""
        if self.top_logprobs is None and LOGPROBS_INCLUDE not in (self.include or ()):
            return None
        return self.top_logprobs or 0

    @property
    def function_tools(self) -> list[FunctionTool]:
        return [tool for tool in self.tools or () if isinstance(tool, FunctionTool)]

    @property
    def custom_tools(self) -> list[CustomTool]:
        return [tool for tool in self.tools or () if isinstance(tool, CustomTool)]

    @model_validator(mode="after")
    def _check_combinations(self) -> ResponsesRequest:
        if self.background:
            raise ValueError("background responses are not supported")
        if self.conversation is not None:
            raise ValueError("conversation is not supported; use previous_response_id")
        if self.prompt is not None:
            raise ValueError("prompt: stored prompts are not supported; send their text as "
                             "instructions and input")
        if not self.input and not self.instructions and self.previous_response_id is None:
            raise ValueError("input is empty, and there are no instructions to answer")
        return self

    @field_validator("max_output_tokens", mode="before")
    @classmethod
    def _at_least_the_least_output(cls, value: Any) -> Any:
        """The bound's 400 with OpenAI's code and words (the field's `ge` declares it)."""
        if type(value) is int and value < MIN_OUTPUT_TOKENS:
            raise PydanticCustomError(  # OpenAI's code for it, and its words
                "integer_below_min_value", "integer below minimum value. Expected a value "
                ">= {least}, but got {value} instead.", {"least": MIN_OUTPUT_TOKENS,
                                                           "value": value})
        return value

    # Fields' validators rather than the model's, so a 400 names its field; tools is
    # validated before tool_choice.
    @field_validator("tools")
    @classmethod
    def _tool_names_are_unique(cls, value: list[ToolDefinition] | None
                               ) -> list[ToolDefinition] | None:
        check_tool_names(_model_tool_names(value))
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_tools(cls, value: ToolChoice | None, info: ValidationInfo
                                 ) -> ToolChoice | None:
        tools = info.data.get("tools")
        names = _model_tool_names(tools)
        if value not in (None, "none", "auto") and not names:
            if tools:  # hosted ones alone, which the model is not shown
                raise ValueError("tool_choice needs a function or custom tool: hosted tools "
                                 "(web_search, ...) are not run by this server")
            raise ValueError("tool_choice needs tools")
        if isinstance(value, FunctionChoice | CustomChoice):
            chosen = [value.name]
        elif isinstance(value, AllowedToolsChoice):
            chosen = [tool.name for tool in value.tools]
        else:
            chosen = []
        for name in chosen:
            if name not in names:
                raise ValueError(f"tool_choice names {name!r}, which is not a tool")
        return value


def _model_tool_names(tools: list[ToolDefinition] | None) -> list[str]:
    """The names of the function and custom tools among `tools`: those the model sees."""
    return [tool.name for tool in tools or () if isinstance(tool, FunctionTool | CustomTool)]


# -- responses -----------------------------------------------------------------------------


class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(ResponseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(ResponseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class OutputFunctionCall(ResponseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class OutputReasoning(ResponseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: ItemStatus


class OutputCustomToolCall(ResponseModel):
    type: Literal["custom_tool_call"] = "custom_tool_call"
    id: str
    call_id: str
    name: str
    input: str
    status: ItemStatus


OutputItem = OutputMessage | OutputFunctionCall | OutputCustomToolCall | OutputReasoning


class InputTokensDetails(ResponseModel):
    cached_tokens: int
    # Every prompt token computed is kept in the radix tree for later requests.
    cache_write_tokens: int


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(ResponseModel):
    code: str
    message: str


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens"]


class ReasoningSettings(ResponseModel):
    """The reasoning settings a response echoes (OpenAI's nulls where none were asked)."""

    effort: str | None = None
    summary: str | None = None


class Response(ResponseModel):
    """A response, with the settings it was made with echoed as OpenAI's: what the
    request left out as its default."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=now)
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool | CustomTool] = Field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    max_output_tokens: int | None = Field(None, ge=MIN_OUTPUT_TOKENS)
    temperature: float | None = None
    top_p: float | None = None
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    reasoning: ReasoningSettings = Field(default_factory=ReasoningSettings)
    service_tier: Literal["default"] = "default"
    background: bool = False
    max_tool_calls: int | None = None
    usage: ResponseUsage | None = None

    @property
    def output_text(self) -> str:
        return "".join(
            part.text for item in self.output if isinstance(item, OutputMessage)
            for part in item.content
        )


class InputItemList(ResponseModel):
    """A page of a stored response's input items (GET /v1/responses/{id}/input_items)."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class InputTokenCount(ResponseModel):
    """What POST /v1/responses/input_tokens answers."""

    object: Literal["response.input_tokens"] = "response.input_tokens"
    input_tokens: int


class DeletedResponse(ResponseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


# -- stream events (each carries `sequence_number`, set when it is sent) ------------------


class Event(ResponseModel):
    type: str
    sequence_number: int = 0


class ResponseEvent(Event):
    """response.created / in_progress / completed / incomplete / failed."""

    response: Response


class ItemEvent(Event):
    """response.output_item.added / done."""

    output_index: int
    item: OutputItem


class PartEvent(Event):
    """response.content_part.added / done."""

    item_id: str
    output_index: int
    content_index: int = 0
    part: OutputText | ReasoningText


class TextDeltaEvent(Event):
    """response.output_text.delta, response.reasoning_text.delta."""

    item_id: str
    output_index: int
    content_index: int = 0
    delta: str
    logprobs: list[Any] | None = None


class TextDoneEvent(Event):
    """response.output_text.done, response.reasoning_text.done."""

    item_id: str
    output_index: int
    content_index: int = 0
    text: str
    logprobs: list[Any] | None = None


class ArgumentsDeltaEvent(Event):
    type: Literal["response.function_call_arguments.delta"] = (
        "response.function_call_arguments.delta"
    )
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(Event):
    type: Literal["response.function_call_arguments.done"] = (
        "response.function_call_arguments.done"
    )
    item_id: str
    output_index: int
    name: str
    arguments: str


class CustomInputDeltaEvent(Event):
    type: Literal["response.custom_tool_call_input.delta"] = (
        "response.custom_tool_call_input.delta"
    )
    item_id: str
    output_index: int
    delta: str


class CustomInputDoneEvent(Event):
    type: Literal["response.custom_tool_call_input.done"] = (
        "response.custom_tool_call_input.done"
    )
    item_id: str
    output_index: int
    input: str


class ErrorEvent(Event):
    type: Literal["error"] = "error"
    code: str | None
    message: str
    param: str | None


StreamEvent = (
    ResponseEvent | ItemEvent | PartEvent | TextDeltaEvent | TextDoneEvent | ArgumentsDeltaEvent
    | ArgumentsDoneEvent | CustomInputDeltaEvent | CustomInputDoneEvent | ErrorEvent
)
