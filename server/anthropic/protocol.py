"""Pydantic models of Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`).

Requests validate declaratively, like the OpenAI models: strict types, unknown fields
ignored (clients such as Claude Code send many we have no use for: `metadata`,
`context_management`, `service_tier`, ...). Image blocks (base64 or URL sources) are read
by vision models (server/images.py), text documents and search results read in as
text (server/documents.py); Anthropic's schema-less client tools (bash, the text editor,
memory) are shown with the schemas it documents (defined_tools.py); what no model here
reads (PDF documents, Anthropic's server-side tools) is refused with a 400 that names
it. Responses and stream events mirror what the official `anthropic` SDK parses.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, field_validator, model_serializer, model_validator

from engine.api import SpeculationMode
from server.anthropic.defined_tools import DEFINED_TOOLS
from server.documents import ReadInText, document, search_result, text_of
from server.schema import (
    ObjectSchema,
    RequestModel,
    ResponseModel,
    StopStrings,
    check_tool_names,
    shaped_union,
    str_or_list,
)

# -- request pieces ----------------------------------------------------------------------


class CacheControl(RequestModel):
    """Accepted and otherwise ignored: the radix cache keeps every prefix anyway."""

    type: Literal["ephemeral"]
    ttl: str | None = None  # "5m", "1h"; new ones must not fail a request


class Block(RequestModel):
    cache_control: CacheControl | None = None


class TextBlock(Block):
    type: Literal["text"]
    text: str


class Base64Source(RequestModel):
    type: Literal["base64"]
    media_type: str
    data: str

    @property
    def url(self) -> str:
        return f"data:{self.media_type};base64,{self.data}"


class URLSource(RequestModel):
    type: Literal["url"]
    url: str  # fetched only from the hosts the server allows (server/images.py)


class ImageBlock(Block):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]


class ToolUseBlock(Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ThinkingBlock(Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Block):
    """Encrypted thinking from Anthropic's models: nothing a local model can read."""

    type: Literal["redacted_thinking"]
    data: str


class UnsupportedBlock(RequestModel):
    type: str

    @model_validator(mode="after")
    def _refuse(self) -> UnsupportedBlock:
        raise ValueError(f"content blocks of type {self.type!r} are not supported")


def _blocks(*members: type[RequestModel]) -> Any:
    """A list of content blocks told apart by `type`; unknown types get a clear 400."""
    tags = {member.model_fields["type"].annotation.__args__[0]: member for member in members}

    def kind(value: Any) -> str | None:
        if not isinstance(value, dict) or not isinstance(value.get("type"), str):
            return None
        return value["type"] if value["type"] in tags else "unsupported"

    union = Union[  # noqa: UP007
        tuple(Annotated[member, Tag(tag)] for tag, member in tags.items())
        + (Annotated[UnsupportedBlock, Tag("unsupported")],)
    ]
    return list[Annotated[union, Discriminator(
        kind, custom_error_type="invalid_type",
        custom_error_message="must be a content block object with a type",
    )]]


class PlainTextSource(RequestModel):
    type: Literal["text"]
    media_type: Literal["text/plain"] = "text/plain"
    data: str


DocumentContent = shaped_union(
    str_or_list, "a string or a list of text blocks", str=str, list=_blocks(TextBlock)
)


class ContentSource(RequestModel):
    """A document given as content blocks: text only here (a page's images are not
    placed in a document's text)."""

    type: Literal["content"]
    content: DocumentContent


class FileSource(RequestModel):
    type: Literal["file"]
    file_id: str


class DocumentBlock(Block, ReadInText):
    """A document, read in as text (server/documents.py): a text or content source, or
    base64 of a text/* file. A PDF, a URL or a file id is a 400 saying to send the text.
    `citations` is accepted and ignored: answers cite nothing."""

    type: Literal["document"]
    source: Annotated[Base64Source | PlainTextSource | ContentSource | URLSource | FileSource,
                      Field(discriminator="type")]
    title: str | None = None
    context: str | None = None
    citations: dict[str, Any] | None = None

    def read_in(self) -> str:
        return document(self._source_text(), self.title, self.context)

    def _source_text(self) -> str:
        source = self.source
        if isinstance(source, PlainTextSource):
            return source.data
        if isinstance(source, ContentSource):
            content = source.content
            return content if isinstance(content, str) else "\n".join(b.text for b in content)
        if isinstance(source, Base64Source):
            return text_of(source.media_type, source.data)
        raise ValueError(f"a document's {source.type} source is not read by this server "
                         "(no fetching, no Files API): send the document's text")


class SearchResultBlock(Block):
    """A search result (what a RAG tool found), read in as text (server/documents.py).
    `citations` is accepted and ignored."""

    type: Literal["search_result"]
    source: str
    title: str
    content: list[TextBlock]
    citations: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        """The result as its message shows it."""
        return search_result(self.source, self.title,
                             "\n".join(block.text for block in self.content))


ToolResultContent = shaped_union(
    str_or_list, "a string or a list of text, image, document and search result blocks",
    str=str, list=_blocks(TextBlock, ImageBlock, DocumentBlock, SearchResultBlock)
)


class ToolResultBlock(Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: ToolResultContent = ""
    is_error: bool = False


ContentBlock = _blocks(TextBlock, ImageBlock, DocumentBlock, SearchResultBlock, ToolUseBlock,
                       ToolResultBlock, ThinkingBlock, RedactedThinkingBlock)
Content = shaped_union(
    str_or_list, "a string or a list of content blocks", str=str, list=ContentBlock
)


class AnthropicMessage(RequestModel):
    """A turn. `system` is the mid-conversation system message Claude Code sends (with an
    `anthropic-beta: mid-conversation-system-...` header): instructions at that point of
    the conversation, in text only."""

    role: Literal["user", "assistant", "system"]
    content: Content

    @model_validator(mode="after")
    def _system_is_text(self) -> AnthropicMessage:
        if self.role == "system" and not isinstance(self.content, str) and any(
                not isinstance(block, TextBlock) for block in self.content):
            raise ValueError("a system message holds text blocks only")
        if isinstance(self.content, str):
            return self
        if self.role == "assistant" and any(
                isinstance(block, ImageBlock | DocumentBlock | SearchResultBlock
                           | ToolResultBlock) for block in self.content):
            raise ValueError("image, document, search result and tool_result blocks belong "
                             "in user messages")
        if self.role == "user" and any(
                isinstance(block, ToolUseBlock | ThinkingBlock | RedactedThinkingBlock)
                for block in self.content):
            raise ValueError("tool_use and thinking blocks belong in assistant messages")
        return self

    @property
    def images(self) -> list[str]:
        """Its image blocks' sources as URLs (base64 as data: URLs), in the order the
        prompt shows them: a user turn's tool results' (a screenshot a tool returned)
        first, as they come first (`chat_messages`), then its own."""
        if isinstance(self.content, str):
            return []
        results = [part.source.url for block in self.content
                   if isinstance(block, ToolResultBlock) and not isinstance(block.content, str)
                   for part in block.content if isinstance(part, ImageBlock)]
        own = [block.source.url for block in self.content if isinstance(block, ImageBlock)]
        return (results if self.role == "user" else []) + own


System = shaped_union(
    str_or_list, "a string or a list of text blocks", str=str, list=_blocks(TextBlock)
)


class Tool(RequestModel):
    """A client tool. Anthropic's server tools (web search, code execution, ...) have a
    versioned `type` and no `input_schema`; they are refused by `_tool_kind`."""

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=128, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    input_schema: ObjectSchema
    strict: bool | None = None
    cache_control: CacheControl | None = None


class AnthropicDefinedTool(RequestModel):
    """Bash, the text editor or memory, by version (defined_tools.py): named, not
    described; the model is shown the schema Anthropic documents for it."""

    type: Literal[tuple(DEFINED_TOOLS)]  # type: ignore[valid-type]
    name: str
    max_characters: int | None = Field(None, ge=1)
    cache_control: CacheControl | None = None

    @model_validator(mode="after")
    def _check(self) -> AnthropicDefinedTool:
        defined = DEFINED_TOOLS[self.type]
        if self.name != defined.name:
            raise ValueError(f"a {self.type} tool is named {defined.name!r}, not {self.name!r}")
        if self.max_characters is not None and not defined.takes_max_characters:
            raise ValueError(f"a {self.type} tool takes no max_characters")
        return self


class ServerTool(RequestModel):
    type: str

    @model_validator(mode="after")
    def _refuse(self) -> ServerTool:
        raise ValueError(
            f"{self.type!r} tools are not supported (server tools and computer use); "
            "define client tools with a name and an input_schema"
        )


def _tool_kind(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    kind = value.get("type")
    if kind in (None, "custom"):
        return "client"
    return "defined" if isinstance(kind, str) and kind in DEFINED_TOOLS else "server"


ToolDefinition = Annotated[
    Annotated[Tool, Tag("client")] | Annotated[AnthropicDefinedTool, Tag("defined")]
    | Annotated[ServerTool, Tag("server")],
    Discriminator(_tool_kind, custom_error_type="invalid_type",
                  custom_error_message="must be a tool object"),
]


class ToolChoiceAuto(RequestModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(RequestModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(RequestModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(RequestModel):
    type: Literal["none"]


ToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")
]


# Anthropic's least thinking budget.
MIN_THINKING_BUDGET = 1024
# The least top_p Anthropic takes with thinking on (its "Feature compatibility").
MIN_THINKING_TOP_P = 0.95


class ThinkingEnabled(RequestModel):
    """Anthropic's bounds on the budget are checked (at least 1024:
    `TokenCountRequest._budget_at_least_the_least`; below max_tokens:
    `MessagesRequest.thinking_over_budget`), so a request that Anthropic refuses is
    refused here too; the budget itself does not bound the reasoning of a local model."""

    type: Literal["enabled"]
    budget_tokens: int
    # "omitted": thinking blocks come without their text (`TokenCountRequest.omit_thinking`).
    display: Literal["summarized", "omitted"] | None = None


class ThinkingAdaptive(RequestModel):
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(RequestModel):
    """Thinking off. `between_tools` (the SDK's newest type) is off too: Anthropic's models
    then return only their notes between tool calls as thinking blocks, and any text a
    model here writes inside its thinking markers is returned as one anyway."""

    type: Literal["disabled", "between_tools"]


Thinking = Annotated[
    ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")
]


class JsonSchemaFormat(RequestModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestModel):
    format: JsonSchemaFormat | None = None
    effort: str | None = None


class TokenCountRequest(RequestModel):
    """What `/v1/messages/count_tokens` takes: a message request without `max_tokens`."""

    model: str = Field(min_length=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: System | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # The structured-outputs beta's name for output_config.format, which clients written
    # for that beta (the SDKs of its time sent it as given) still send: read as
    # output_config.format, not ignored.
    output_format: JsonSchemaFormat | None = None
    # Anthropic's MCP connector (tools that Anthropic's side fetches from remote MCP
    # servers and runs) and the code-execution container (with its Agent Skills): both
    # are server-side, as its server tools are. Ignored, the model would answer without
    # the tools the client counts on, so each is refused with a 400 that names it.
    mcp_servers: list[Any] | None = None
    container: Any = None

    @field_validator("messages")
    @classmethod
    def _prefill_ends_in_text(cls, messages: list[AnthropicMessage]) -> list[AnthropicMessage]:
        """A final assistant message (a prefill) whose text ends in whitespace is
        Anthropic's 400, in its words: the reply would continue after a space or newline
        the model's own tokens would have carried."""
        last = messages[-1] if messages else None
        if last is None or last.role != "assistant":
            return messages
        content = last.content
        if not isinstance(content, str):
            content = content[-1].text if content and isinstance(content[-1], TextBlock) else ""
        if content[-1:].isspace():
            raise ValueError("final assistant content cannot end with trailing whitespace")
        return messages

    @property
    def omit_thinking(self) -> bool:
        """Whether thinking blocks leave out their text (display "omitted"), as Anthropic's
        do where a client shows no reasoning: the blocks still come, empty."""
        return getattr(self.thinking, "display", None) == "omitted"

    @model_validator(mode="after")
    def _refuse_server_side_features(self) -> TokenCountRequest:
        if self.mcp_servers:
            raise ValueError("mcp_servers: this server does not connect to MCP servers; "
                             "run the MCP client on your side and pass its tools as tools")
        if self.container is not None:
            raise ValueError("container: this server runs no code-execution container "
                             "(nor its skills); define client tools instead")
        return self

    @model_validator(mode="after")
    def _budget_at_least_the_least(self) -> TokenCountRequest:
        """A budget below 1024 is Anthropic's 400 in its words, its path naming the
        thinking type (where ours leaves union tags out): gateways that raise a budget
        too low for Anthropic match on them."""
        if (isinstance(self.thinking, ThinkingEnabled)
                and self.thinking.budget_tokens < MIN_THINKING_BUDGET):
            raise ValueError("thinking.enabled.budget_tokens: Input should be greater than "
                             f"or equal to {MIN_THINKING_BUDGET}")
        return self

    @model_validator(mode="after")
    def _output_format_is_output_config_format(self) -> TokenCountRequest:
        if self.output_format is None:
            return self
        if self.output_config is not None and self.output_config.format is not None:
            raise ValueError("output_format is the former name of output_config.format: "
                             "send one of them")
        config = self.output_config or OutputConfig()
        self.output_config = config.model_copy(update={"format": self.output_format})
        return self

    @model_validator(mode="after")
    def _check_tool_choice(self) -> TokenCountRequest:
        names = [tool.name for tool in self.tools or ()]
        check_tool_names(names)
        if isinstance(self.tool_choice, ToolChoiceAny | ToolChoiceTool) and not names:
            raise ValueError(f"tool_choice {self.tool_choice.type!r} needs tools")
        if isinstance(self.tool_choice, ToolChoiceTool) and self.tool_choice.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.name!r}, which is not a tool")
        return self


class MessagesRequest(TokenCountRequest):
    max_tokens: int = Field(ge=1)
    # Anthropic names no limit; every one is matched against each token's text, so a
    # request with 300,000 of them slowed everyone's streams to a third.
    stop_sequences: StopStrings | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    # radix-mlx's: speculative decoding for this request (none: the server's mode).
    speculation: SpeculationMode | None = None
    # Anthropic's message threads: the server holds the conversation, and a `continue`
    # sends only the new messages, without `system` and `tools`. Nothing is held here, so
    # a thread is refused (the route's `ThreadNotHeld`) rather than ignored, which would
    # answer a tool result alone.
    thread: Any = None

    @field_validator("stop_sequences")
    @classmethod
    def _stop_sequences_have_text(cls, value: list[str] | None) -> list[str] | None:
        """Anthropic refuses a stop sequence that is empty or only whitespace, in these
        words; one of whitespace would stop a reply at its first space or newline."""
        for stop in value or ():
            if not stop:
                raise ValueError("each stop sequence must be non-empty")
            if stop.isspace():
                raise ValueError("each stop sequence must contain non-whitespace")
        return value

    @model_validator(mode="after")
    def _sampling_fits_thinking(self) -> MessagesRequest:
        """Anthropic's models think at their own sampling: with thinking on (enabled or
        adaptive) a temperature other than 1, any top_k and a top_p below 0.95 are its
        400s, in its words. Unset, a model here samples at its own defaults."""
        if not isinstance(self.thinking, ThinkingEnabled | ThinkingAdaptive):
            return self
        if self.temperature is not None and self.temperature != 1:
            raise ValueError("`temperature` may only be set to 1 when thinking is enabled "
                             "or in adaptive mode")
        if self.top_k is not None:
            raise ValueError("`top_k` must be unset when thinking is enabled or in adaptive "
                             "mode")
        if self.top_p is not None and self.top_p < MIN_THINKING_TOP_P:
            raise ValueError(f"`top_p` must be between {MIN_THINKING_TOP_P} and 1 when "
                             "thinking is enabled or in adaptive mode")
        return self

    @model_validator(mode="after")
    def _no_forced_tool_while_thinking(self) -> MessagesRequest:
        """A forced call (tool_choice any or tool) with thinking on is Anthropic's 400, in
        its words: the call would come before any thinking."""
        thinking = isinstance(self.thinking, ThinkingEnabled | ThinkingAdaptive)
        if thinking and isinstance(self.tool_choice, ToolChoiceAny | ToolChoiceTool):
            raise ValueError("Thinking may not be enabled when tool_choice forces tool use.")
        return self

    def thinking_over_budget(self, interleaved: bool) -> bool:
        """Whether the thinking budget is not below max_tokens, which Anthropic refuses
        unless thinking is `interleaved` (its beta), where the budget is the whole turn's,
        across tool calls."""
        return (isinstance(self.thinking, ThinkingEnabled) and not interleaved
                and self.thinking.budget_tokens >= self.max_tokens)


# -- responses -----------------------------------------------------------------------------

StopReason = Literal[
    "end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"
]


class Usage(ResponseModel):
    """Anthropic counts cache reads apart from `input_tokens`: the prompt is the sum."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class TextContent(ResponseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseContent(ResponseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingContent(ResponseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    # Anthropic signs its thinking so it can be verified when sent back; ours is local.
    signature: str = ""


ResponseContent = TextContent | ToolUseContent | ThinkingContent


class MessageResponse(ResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ResponseContent]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: Usage


class TokenCount(ResponseModel):
    input_tokens: int


# -- stream events -------------------------------------------------------------------------


class MessageStart(ResponseModel):
    type: Literal["message_start"] = "message_start"
    message: MessageResponse


class ContentBlockStart(ResponseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ResponseContent


class TextDelta(ResponseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(ResponseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ThinkingDelta(ResponseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class ContentBlockDelta(ResponseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | InputJsonDelta | ThinkingDelta


class ContentBlockStop(ResponseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDeltaBody(ResponseModel):
    stop_reason: StopReason
    stop_sequence: str | None


class MessageDelta(ResponseModel):
    """The closing usage is cumulative: the SDK takes it as the message's final usage."""

    type: Literal["message_delta"] = "message_delta"
    delta: MessageDeltaBody
    usage: Usage


class MessageStop(ResponseModel):
    type: Literal["message_stop"] = "message_stop"


class Ping(ResponseModel):
    type: Literal["ping"] = "ping"


StreamEvent = (
    MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta
    | MessageStop | Ping
)


# -- errors --------------------------------------------------------------------------------

ErrorType = Literal[
    "invalid_request_error", "authentication_error", "permission_error", "not_found_error",
    "request_too_large", "rate_limit_error", "api_error", "overloaded_error",
]


class ErrorInfo(ResponseModel):
    type: ErrorType
    message: str
    # What a client acts on (`error_code`, ...), where Anthropic's error has it.
    details: dict[str, Any] | None = None

    @model_serializer(mode="wrap")
    def _without_absent_details(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("details") is None:
            data.pop("details", None)
        return data


class ErrorResponse(ResponseModel):
    type: Literal["error"] = "error"
    error: ErrorInfo
    request_id: str | None = None


def error_type(status: int) -> ErrorType:
    """Anthropic's error type for an HTTP status (docs: "HTTP errors")."""
    return {
        401: "authentication_error", 403: "permission_error", 404: "not_found_error",
        413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
        529: "overloaded_error",
    }.get(status, "api_error" if status >= 500 else "invalid_request_error")
