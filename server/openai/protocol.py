"""Pydantic models of the OpenAI API surface we serve.

Requests mirror OpenAI's schema (plus vLLM's sampling extensions) and validate
declaratively: strict types, so `"n": "2"` is a 400 rather than a silent coercion, and
unknown fields are ignored, as OpenAI does. Responses mirror the shapes the official SDK
parses. Nothing here knows about the engine: `server.openai.adapter` translates these
requests into the internal `GenerationRequest`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from engine.api import SpeculationMode
from server.documents import ReadInText, document, text_of_data_url
from server.schema import (
    MAX_STOP_STRINGS,
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
    FormatName,
    IdleTtl,
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

# -- shared request pieces ---------------------------------------------------------------

TokenId = Annotated[int, Field(ge=0)]
# OpenAI keys logit_bias by token id written as a string: in ASCII decimal (the regex's \d
# took other scripts' digits) without leading zeros, so no two keys name one token.
TokenIdKey = Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,8})$")]
LogitBias = Annotated[float, Field(ge=-100, le=100)]
StopString = Annotated[str, Field(min_length=1)]


def _str_or_list(value: Any) -> str | None:
    return "str" if isinstance(value, str) else "list" if isinstance(value, list) else None


Stop = shaped_union(
    _str_or_list, f"a string or a list of up to {MAX_STOP_STRINGS} strings",
    str=StopString, list=Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)],
)


class StreamOptions(RequestModel):
    include_usage: bool = False


class SamplingRequest(RequestModel):
    """Fields shared by chat and legacy completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=128)
    # MLX seeds are unsigned 64-bit; choice i of n uses seed + i. -1 is no seed, as in
    # llama.cpp, whose front ends send it for "random" (`_minus_one_is_no_seed`).
    seed: int | None = Field(None, ge=-1, lt=2**63)
    stop: Stop | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[TokenIdKey, LogitBias] | None = None
    user: str | None = None
    # Extensions, as in vLLM's server.
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    # Seen tokens' logits are divided by it: a float32 zero (e.g. 5e-324) made them infinite
    # and the logprobs NaN. At 0.01 they are already multiplied by 100.
    repetition_penalty: float | None = Field(None, ge=0.01, le=10)
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    # radix-mlx's: speculative decoding for this request (none: the server's mode).
    speculation: SpeculationMode | None = None

    @field_validator("seed")
    @classmethod
    def _minus_one_is_no_seed(cls, value: int | None) -> int | None:
        return None if value == -1 else value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo
                                    ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return value

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens_within_max_tokens(cls, value: int, info: ValidationInfo) -> int:
        limit = info.data.get("max_tokens")
        if limit is not None and value > limit:
            raise ValueError(f"must be at most max_tokens ({limit})")
        return value


# -- chat requests -------------------------------------------------------------------------


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ImageURL(RequestModel):
    url: str  # a data: URL, or http(s) from the hosts the server allows (server/images.py)
    detail: Literal["auto", "low", "high"] | None = None  # the processor decides


class ImagePart(RequestModel):
    type: Literal["image_url"]
    image_url: ImageURL


class FileData(RequestModel):
    file_data: str | None = None  # a data: URL
    file_id: str | None = None
    filename: str | None = None


class FilePart(ReadInText):
    """A file, read in as text where its `file_data` is a data: URL of a text/* file
    (server/documents.py); a PDF or a `file_id` is a 400."""

    type: Literal["file"]
    file: FileData

    def read_in(self) -> str:
        if self.file.file_data is None:
            raise ValueError("a file part needs file_data (a data: URL of a text file); "
                             "this server has no Files API for file_id")
        return document(text_of_data_url(self.file.file_data), self.file.filename)


ContentPart = Annotated[TextPart | ImagePart | FilePart, Field(discriminator="type")]

Content = shaped_union(
    _str_or_list, "a string or a list of text, image and file parts", str=str,
    list=list[ContentPart]
)


class FunctionCall(RequestModel):
    name: str
    arguments: str


class ToolCall(RequestModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class CustomCall(RequestModel):
    name: str
    input: str


class CustomToolCall(RequestModel):
    """A call of a custom tool, sent back: its input is freeform text."""

    id: str
    type: Literal["custom"]
    custom: CustomCall


def _call_kind(value: Any) -> str | None:
    """A call's type, in a request's JSON (where a function call's may be left out) or
    its model (dumped for the template)."""
    if isinstance(value, ToolCall | CustomToolCall):
        return value.type
    kind = value.get("type", "function") if isinstance(value, dict) else None
    return kind if kind in ("function", "custom") else None


AnyToolCall = shaped_union(_call_kind, "a function or custom tool call",
                           function=ToolCall, custom=CustomToolCall)


class SystemMessage(RequestModel):
    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(RequestModel):
    role: Literal["user"]
    content: Content
    name: str | None = None


AssistantContent = shaped_union(
    _str_or_list, "a string or a list of text and refusal parts", str=str,
    list=list[Annotated[TextPart | RefusalPart, Field(discriminator="type")]]
)


class AssistantMessage(RequestModel):
    role: Literal["assistant"]
    content: AssistantContent | None = None
    refusal: str | None = None  # a refused turn sent back: its text is the turn's
    name: str | None = None
    tool_calls: list[AnyToolCall] | None = None
    # An earlier turn's thinking, as vLLM takes it back; templates decide whether to
    # render it (Qwen3's keeps only the current turn's).
    reasoning_content: str | None = None
    # The final message as the start of the reply, which goes on from it: Mistral's and
    # DeepSeek's `prefix`, Moonshot's `partial` (vLLM's continue_final_message).
    prefix: bool = False
    partial: bool = False

    @property
    def starts_the_reply(self) -> bool:
        return self.prefix or self.partial

    @model_validator(mode="after")
    def _says_something(self) -> AssistantMessage:
        # As OpenAI's API: content may be null only beside tool calls or a refusal (a
        # template met the null and answered in its own words: "'dict object' has no
        # attribute").
        if self.content is None and not self.tool_calls and self.refusal is None:
            raise ValueError("an assistant message needs content, a refusal or tool_calls")
        return self


class ToolMessage(RequestModel):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


ChatRequestMessage = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: ObjectSchema | None = None
    strict: bool | None = None


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class CustomGrammar(RequestModel):
    definition: str = Field(min_length=1)
    syntax: Literal["lark", "regex"]


class CustomFormat(RequestModel):
    """What a custom tool's input is: free text, or text in a grammar (Lark or a regular
    expression), which the model is shown."""

    type: Literal["text", "grammar"]
    grammar: CustomGrammar | None = None

    @model_validator(mode="after")
    def _grammar_given(self) -> CustomFormat:
        if self.type == "grammar" and self.grammar is None:
            raise ValueError("a grammar format needs its grammar (syntax and definition)")
        return self


class CustomDefinition(RequestModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    format: CustomFormat | None = None

    @property
    def grammar(self) -> tuple[Literal["lark", "regex"], str] | None:
        """Its input's grammar (syntax, definition); None: free text."""
        fmt = self.format
        if fmt is None or fmt.type != "grammar" or fmt.grammar is None:
            return None
        return fmt.grammar.syntax, fmt.grammar.definition


class CustomTool(RequestModel):
    """A tool whose input is freeform text (a patch, a shell command, a query)."""

    type: Literal["custom"]
    custom: CustomDefinition


AnyTool = Annotated[Tool | CustomTool, Field(discriminator="type")]


def tool_name(tool: Tool | CustomTool) -> str:
    return tool.function.name if isinstance(tool, Tool) else tool.custom.name


class TextFormat(RequestModel):
    type: Literal["text"]


class JsonObjectFormat(RequestModel):
    type: Literal["json_object"]


class JsonSchema(RequestModel):
    name: FormatName
    description: str | None = None
    # "schema" would shadow a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(RequestModel):
    type: Literal["json_schema"]
    json_schema: JsonSchema


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]


class FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: FunctionName


class NamedCustomChoice(RequestModel):
    type: Literal["custom"]
    custom: FunctionName


NamedChoice = NamedToolChoice | NamedCustomChoice


def chosen_name(choice: NamedChoice) -> str:
    return choice.function.name if isinstance(choice, NamedToolChoice) else choice.custom.name


class AllowedToolsSet(RequestModel):
    mode: Literal["auto", "required"]
    tools: list[Annotated[NamedChoice, Field(discriminator="type")]] = Field(min_length=1)


class AllowedToolsChoice(RequestModel):
    """Only these of the tools may be called; the model still sees them all."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedToolsSet


ToolChoice = tool_choice_union(function=NamedToolChoice, custom=NamedCustomChoice,
                               allowed_tools=AllowedToolsChoice)


def _schema_document(value: Any) -> Any:
    """A JSON Schema as vLLM and SGLang take it: an object, or the JSON text of one."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        raise ValueError("a JSON Schema, as an object or its JSON text; this text is not "
                         "valid JSON") from None


def _empty_is_unset(value: Any) -> Any:
    # llama.cpp's front ends send "grammar": "" for no grammar.
    return None if value == "" else value


SchemaDocument = Annotated[dict[str, Any], BeforeValidator(_schema_document)]
GrammarText = Annotated[str | None, BeforeValidator(_empty_is_unset)]
Choices = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]


def _no_structural_tag(value: Any) -> Any:
    if value not in (None, "", [], {}):
        raise ValueError("not supported: for tool calls send tools and tool_choice")
    return value


class StructuredOutputs(RequestModel):
    """vLLM's `structured_outputs`: one constraint of these. Its backend's options
    (`disable_fallback`, `whitespace_pattern`, ...) are ignored, as unknown fields are."""

    json_: SchemaDocument | None = Field(None, alias="json")
    regex: GrammarText = None
    choice: Choices | None = None
    grammar: GrammarText = None
    json_object: bool | None = None
    structural_tag: Annotated[Any, AfterValidator(_no_structural_tag)] = None

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputs:
        given = [kind for kind, value in self._constraints() if value is not None]
        if len(given) > 1:
            raise ValueError(f"one constraint at most, not {given[0]} and {given[1]}")
        return self

    def _constraints(self) -> list[tuple[str, Any]]:
        return [("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                ("grammar", self.grammar), ("json_object", self.json_object or None)]

    def constraint(self) -> tuple[str, Any] | None:
        """(the kind of output asked for: json, regex, choice, grammar or json_object, its
        definition), or None where none is."""
        return next(((kind, value) for kind, value in self._constraints() if value is not None),
                    None)


# Other servers' grammar fields, in the order a request's fields are validated, with the
# kind of output each asks for (structured_outputs says its own).
FOREIGN_OUTPUT_FIELDS = {"structured_outputs": None, "guided_json": "json",
                         "guided_regex": "regex", "guided_choice": "choice",
                         "guided_grammar": "grammar", "json_schema": "json", "grammar": "grammar",
                         "regex": "regex", "ebnf": "grammar"}


class StructuredOutputRequest(SamplingRequest):
    """Fields shared by chat and legacy completions on top of sampling: the output format,
    OpenAI's `response_format` or one of other servers' grammar fields, honoured as those
    servers do (a client moving from them counts on its grammar): vLLM's
    `structured_outputs` and `guided_*`, llama.cpp's `json_schema` and GBNF `grammar`,
    SGLang's `regex`, `ebnf` and `json_schema` (its text)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: SchemaDocument | None = None
    guided_regex: GrammarText = None
    guided_choice: Choices | None = None
    guided_grammar: GrammarText = None
    json_schema: SchemaDocument | None = None
    grammar: GrammarText = None
    regex: GrammarText = None
    ebnf: GrammarText = None
    structural_tag: Annotated[Any, AfterValidator(_no_structural_tag)] = None

    @field_validator(*FOREIGN_OUTPUT_FIELDS)
    @classmethod
    def _one_output_format(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            return value
        response_format = info.data.get("response_format")
        if response_format is not None and not isinstance(response_format, TextFormat):
            raise ValueError("one output format at most, and response_format is one")
        if earlier := next((name for name in FOREIGN_OUTPUT_FIELDS
                            if info.data.get(name) is not None), None):
            raise ValueError(f"one output format at most, and {earlier} is one")
        return value


PredictionText = shaped_union(
    _str_or_list, "a string or a list of text parts", str=str, list=list[TextPart]
)


class PredictionContent(RequestModel):
    """Predicted Outputs: text the answer is expected to be mostly like (a file asked
    back with an edit), drafts for speculative decoding."""

    type: Literal["content"]
    content: PredictionText


class ChatCompletionRequest(StructuredOutputRequest):
    messages: list[ChatRequestMessage] = Field(min_length=1)
    prediction: PredictionContent | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[AnyTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    ttl: IdleTtl | None = None
    # OpenAI's deprecated function calling: refused by name, where ignoring it served the
    # request as if no function were offered.
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[Literal["text"]] | None = None  # no audio out: a 400, not text alone
    # Nothing is stored here to attach it to: checked against OpenAI's bounds only, so a
    # client that works here works on OpenAI.
    metadata: Metadata | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # The template variable gpt-oss's template reads (others ignore it): vLLM honours it
    # for gpt-oss too. chat_template_kwargs' own reasoning_effort wins.
    reasoning_effort: str | None = None
    # vLLM's: false ends the prompt after the final message instead of opening the reply;
    # continue_final_message (with add_generation_prompt false) makes the reply continue
    # the final message, an assistant prefill.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # One tier serves every request here: whichever is asked for, the response says
    # "default", the tier that served it, as OpenAI's does where a request names one.
    service_tier: str | None = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _room_for_min_tokens(cls, value: int | None, info: ValidationInfo) -> int | None:
        least = info.data.get("min_tokens", 0)
        if value is not None and value < least:
            raise ValueError(f"must be at least min_tokens ({least})")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo
                                    ) -> int | None:
        # A field's validator rather than the model's, so the 400 names top_logprobs;
        # logprobs is validated before it.
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @field_validator("functions", "function_call")
    @classmethod
    def _no_legacy_function_calling(cls, value: Any) -> Any:
        if value not in (None, [], "none"):
            raise ValueError("deprecated function calling is not supported: send tools "
                             '([{"type": "function", "function": {...}}]) and tool_choice')
        return value

    @field_validator("tools")
    @classmethod
    def _tool_names_are_unique(cls, value: list[AnyTool] | None) -> list[AnyTool] | None:
        check_tool_names([tool_name(tool) for tool in value or ()])
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_tools(cls, value: ToolChoice, info: ValidationInfo) -> ToolChoice:
        # A field's validator rather than the model's, so the 400 names tool_choice;
        # tools is validated before it.
        if value is None:  # null is the default, as for any optional field
            return value
        tools = info.data.get("tools")
        if not tools:
            raise ValueError("tool_choice is only allowed when tools are specified")
        named = {(tool.type, tool_name(tool)) for tool in tools}
        chosen = ([value] if isinstance(value, NamedChoice)
                  else value.allowed_tools.tools if isinstance(value, AllowedToolsChoice)
                  else [])
        for choice in chosen:
            name = chosen_name(choice)
            if (choice.type, name) not in named:
                kind = "function" if choice.type == "function" else "custom tool"
                raise ValueError(f"tool_choice names {kind} {name!r}, which is not in tools")
        return value

    @model_validator(mode="after")
    def _check_combinations(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt to be false")
        return self

    @field_validator("messages")
    @classmethod
    def _prefix_last(cls, messages: list[ChatRequestMessage]) -> list[ChatRequestMessage]:
        if any(isinstance(message, AssistantMessage) and message.starts_the_reply
               for message in messages[:-1]):
            raise ValueError("only the final message may start the reply (prefix or "
                             "partial: true)")
        return messages


# -- legacy completion requests ----------------------------------------------------------

def prompt_kind(value: Any) -> str | None:
    """Which shape of OpenAI's prompt (or embeddings input) `value` has, if any."""
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list):
        return None
    first = value[0] if value else 0
    return "texts" if isinstance(first, str) else "batch" if isinstance(first, list) else "tokens"


NonEmptyTokens = Annotated[list[TokenId], Field(min_length=1)]
PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of those"
Prompt = shaped_union(
    prompt_kind, PROMPT_SHAPES,
    text=Annotated[str, Field(min_length=1)],
    texts=Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)],
    tokens=NonEmptyTokens,
    batch=Annotated[list[NonEmptyTokens], Field(min_length=1)],
)


LEGACY_MAX_TOKENS = 16


class CompletionRequest(StructuredOutputRequest):
    prompt: Prompt
    # OpenAI's default for legacy completions, also when null is sent. 0 (with echo): the
    # prompt alone, scored, as lm-evaluation-harness asks for it.
    max_tokens: int | None = Field(LEGACY_MAX_TOKENS, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    ttl: IdleTtl | None = None
    # The prompt comes back before the completion, with its tokens' logprobs if logprobs
    # is set (the first token's is null).
    echo: bool = Field(False, validate_default=True)
    # The text after the completion: the model fills in the middle, where it knows how
    # (engine/fill_in_middle.py). "" says none, as Ollama reads it.
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @field_validator("max_tokens")
    @classmethod
    def _null_means_default(cls, value: int | None) -> int:
        return LEGACY_MAX_TOKENS if value is None else value

    @field_validator("echo")
    @classmethod
    def _something_to_return(cls, value: bool, info: ValidationInfo) -> bool:
        # max_tokens (a SamplingRequest field) is validated before echo.
        if not value and info.data.get("max_tokens") == 0:
            raise ValueError("with max_tokens 0 (no completion) echo must be true")
        return value

    @field_validator("suffix")
    @classmethod
    def _suffix_after_text(cls, value: str | None, info: ValidationInfo) -> str | None:
        if not value:
            return None
        if info.data.get("echo"):
            raise ValueError("echo returns the prompt before its completion, which a "
                             "suffix puts elsewhere: send one of them")
        prompt = info.data.get("prompt")
        if prompt is not None and prompt_kind(prompt) not in ("text", "texts"):
            raise ValueError("a suffix follows a text prompt, not token ids")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value is not None and value > 1:
            raise ValueError("best_of > 1 is not supported")
        return value

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt as a batch: a list of strings or a list of token-id lists."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]  # type: ignore[list-item]
        return self.prompt  # type: ignore[return-value]


class FimCompletionRequest(SamplingRequest):
    """Mistral's fill in the middle (POST /v1/fim/completions, Codestral's API), which
    Continue's Mistral provider and the mistralai SDK's `fim.complete` send: the text
    before the gap (`prompt`) and after it (`suffix`, none: the model continues the
    prompt from within a gap at the end). Its seed is `random_seed`."""

    prompt: str
    suffix: str = ""
    random_seed: int | None = Field(None, ge=0, lt=2**63)


# -- responses -----------------------------------------------------------------------------


class CacheMissDetails(ResponseModel):
    """The first prompt token not reused from the cache (`position`), why (`reason`:
    not_seen, diverged, evicted_from_memory, evicted_from_disk, cleared,
    disk_copy_unreadable, no_snapshot, in_flight, model_reloaded, cache_off), the
    prompt's text `before` and `after` it, and the text the `cached` branch holds there
    instead (diverged)."""

    position: int
    reason: str
    before: str
    after: str
    cached: str = ""


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0
    cache_miss: CacheMissDetails | None = None  # with --cache-miss-details

    @model_serializer(mode="wrap")
    def _without_absent_miss(self, handler):  # OpenAI's shape unless asked for more
        data = handler(self)
        if data.get("cache_miss") is None:
            data.pop("cache_miss", None)
        return data


class CompletionTokensDetails(ResponseModel):
    reasoning_tokens: int = 0
    # Predicted Outputs: tokens of the prediction the model's answer kept, and those it
    # did not (drafted from it and rejected: they cost a verify, not an output token).
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(ResponseModel):
    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(ResponseModel):
    """The legacy format: parallel lists, alternatives as {token text: logprob}."""

    tokens: list[str]
    # null for an echoed prompt's first token, which nothing comes before
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class FunctionCallOut(ResponseModel):
    name: str
    arguments: str


class ToolCallOut(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class CustomCallOut(ResponseModel):
    name: str
    input: str


class CustomToolCallOut(ResponseModel):
    id: str
    type: Literal["custom"] = "custom"
    custom: CustomCallOut


class FunctionCallDelta(ResponseModel):
    name: str | None = None
    arguments: str


class CustomCallDelta(ResponseModel):
    name: str | None = None
    input: str


class ToolCallDelta(ResponseModel):
    """A streamed call: the first delta of call `index` has its id, type and name, later
    ones only the next fragment of its arguments (a custom call's: of its input)."""

    index: int
    id: str | None = None
    type: Literal["function", "custom"] | None = None
    function: FunctionCallDelta | None = None
    custom: CustomCallDelta | None = None

    @model_serializer(mode="wrap")
    def _only_present(self, handler: Any) -> dict[str, Any]:
        out = {key: value for key, value in handler(self).items() if value is not None}
        for call in ("function", "custom"):
            if call in out and out[call]["name"] is None:
                del out[call]["name"]
        return out


FinishReason = Literal["stop", "length", "tool_calls"]


class ChatCompletionMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # The model's thinking, as vLLM and llama.cpp return it (never part of `content`).
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut | CustomToolCallOut] = Field(default_factory=list)
    refusal: None = None


class ChatChoice(ResponseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    service_tier: Literal["default"] | None = None


class DeltaMessage(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _only_present(self, handler: Any) -> dict[str, Any]:
        # A delta carries only what changed: OpenAI omits the other keys.
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    service_tier: Literal["default"] | None = None


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(ResponseModel):
    """OpenAI's model object, with the fields of Anthropic's (`type`, `display_name`,
    `created_at`, ...) too, so both APIs' clients (Claude Code's model discovery among
    them) read the same list."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "radix-mlx"
    root: str
    type: Literal["model"] = "model"
    display_name: str
    created_at: str  # RFC 3339
    lifecycle: Literal["active"] = "active"
    max_input_tokens: int | None  # None: no config known yet (a hub id), or an encoder not loaded
    # radix-mlx's: whether the model is loaded now, and whether it always is.
    state: Literal["loaded", "loading", "unloaded"]
    pinned: bool


class ModelList(ResponseModel):
    """OpenAI's list; Anthropic's pagination fields say it is the whole list."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo
