"""The one request every API front end adapts onto.

OpenAI Chat, OpenAI Responses and Anthropic Messages each validate their own body (one
pydantic schema per API) and translate it into a `GenerationRequest`. Everything after
that is written once, in `server.pipeline`: templating and tokenizing, submitting,
reasoning separation, tool-call parsing, structured output, and the neutral event stream
(`server.events`) that each front end renders in its own shapes.

Nothing here knows an API's field names: the front end maps them (OpenAI's
`max_completion_tokens`, Anthropic's `max_tokens`, Responses' `max_output_tokens` all
become `max_tokens`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import pydantic_core

from engine.api import SamplingKnobs
from engine.tokenizer import ChatEnd
from server.config import SamplingDefaults

# The knobs a model's table may give defaults for.
DEFAULTABLE_KNOBS = tuple(SamplingDefaults.model_fields)


def unset_knobs(body: object) -> frozenset[str]:
    """The defaultable knobs an API body leaves unset (None, or absent from its API)."""
    return frozenset(name for name in DEFAULTABLE_KNOBS if getattr(body, name, None) is None)


# A chat message in the form Hugging Face chat templates take:
#   {"role": "system" | "user" | "assistant" | "tool", "content": str | None,
#    "tool_calls": [{"id", "type": "function", "function": {"name", "arguments": dict}}],
#    "tool_call_id": str, "name": str, "reasoning_content": str}
# Content is a string (text parts joined by the front end); tool-call arguments are a
# mapping, since templates iterate over them (a string is kept when it is not JSON).
TemplateMessage = dict[str, Any]


def template_arguments(arguments: str) -> Any:
    """A call's JSON arguments as the mapping templates iterate over; text that is not
    strict JSON stays a string (a template that prints arguments verbatim still gets it).
    Strict: json.loads would turn a \\ud800 escape into a lone surrogate, which no
    tokenizer can encode."""
    try:
        return pydantic_core.from_json(arguments)
    except ValueError:
        return arguments


def thinking_kwargs(think: bool | str | None) -> dict[str, Any]:
    """Thinking asked for (True), turned off (False) or at an effort level (str), as the
    template variables thinking models read (Qwen3's enable_thinking, gpt-oss's
    reasoning_effort); None: the model's own default."""
    if think is None:
        return {}
    if isinstance(think, bool):
        return {"enable_thinking": think}
    return {"enable_thinking": True, "reasoning_effort": think}


def turn_text(pieces: Iterable[str]) -> str:
    """One chat message's text out of the pieces a front end sends it in (Anthropic's
    text blocks, a run of Responses' assistant message items): a line apart, so words at
    the seams stay apart; an empty piece adds no blank line."""
    return "\n".join(piece for piece in pieces if piece)


def template_call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    """A tool call as chat templates take it (a `TemplateMessage`'s `tool_calls` entry),
    its `arguments` the mapping they iterate over. Every front end and the next-turn
    guess build it here, so a conversation renders alike whichever way it arrives."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass(frozen=True)
class FunctionTool:
    """A function the model may call: what every API's tool definition comes down to."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema for the arguments object
    # Exact adherence asked (OpenAI's `strict: true`): a keyword the grammar cannot
    # enforce is refused.
    strict: bool | None = None
    # The Responses API's default where `strict` is unsaid: the call is bound to the
    # schema (`parameters`, normalized to strict mode by the front end) as a strict one
    # is, but a keyword the grammar cannot enforce is ignored rather than refused.
    strict_by_default: bool = False

    @property
    def bound(self) -> bool:
        """Is a call of it written by the grammar whatever the tool choice?"""
        return bool(self.strict) or self.strict_by_default

    def template_form(self) -> dict[str, Any]:
        """The OpenAI-shaped dict chat templates render tools from."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class NamedFunction:
    """tool_choice forcing a call of this one function."""

    name: str


@dataclass(frozen=True)
class AllowedTools:
    """tool_choice letting the model call only these of the tools, which it still sees
    all of (so the prompt, and what the cache holds of it, stays the same as the allowed
    set changes): "auto" it may answer instead, "required" it calls at least one."""

    mode: Literal["auto", "required"]
    names: tuple[str, ...]


# none: never call (the model still sees the tools, as OpenAI's does); auto: the model decides;
# required: at least one call, of any tool; NamedFunction: exactly that tool.
ToolChoice = Literal["none", "auto", "required"] | NamedFunction | AllowedTools


@dataclass(frozen=True)
class TextOutput:
    """Free text: no constraint on the answer."""


@dataclass(frozen=True)
class JsonObjectOutput:
    """Any valid JSON object (OpenAI's `json_object`)."""


@dataclass(frozen=True)
class JsonSchemaOutput:
    """A JSON value valid against `schema` (OpenAI's `json_schema`, or another server's
    field: `param`, which a 400 for the schema names)."""

    name: str
    schema: dict[str, Any]
    strict: bool = False
    param: str = "response_format"


@dataclass(frozen=True)
class GrammarOutput:
    """Text that is no JSON, in a grammar of another server's field (`param`, named in
    errors): a regular expression, a list of choices, or a Lark or GBNF grammar."""

    kind: Literal["regex", "choice", "grammar"]
    definition: str | tuple[str, ...]  # the choices: a tuple
    param: str


OutputFormat = TextOutput | JsonObjectOutput | JsonSchemaOutput | GrammarOutput
TEXT = TextOutput()


@dataclass(frozen=True)
class Infill:
    """Fill in the middle (engine/fill_in_middle.py): each raw prompt is the text before
    the gap and `suffix` the text after it; `files` are other files of the project, as
    (name, text), for context. `param` names the suffix's field in errors. `fit`: the
    prompt is cut to leave room for the reply, as llama.cpp's /infill cuts it."""

    suffix: str
    files: tuple[tuple[str, str], ...] = ()
    param: str = "suffix"
    fit: bool = False


@dataclass(frozen=True)
class GenerationRequest:
    """One request, whatever API it came through.

    Exactly one of `messages` (a chat, rendered with the model's template) and `prompts`
    (raw prompts, as text or token ids; one generation each: legacy completions) is set.
    Tools, tool_choice and reasoning apply to chats only.
    """

    messages: tuple[TemplateMessage, ...] = ()
    # The chat's images as URLs (data: or http(s)), in order; each one's place in its
    # message's text is an `engine.image_tokens.MARKER`.
    images: tuple[str, ...] = ()
    prompts: tuple[str | tuple[int, ...], ...] = ()
    # Raw text prompts only: the model writes what goes between each prompt and a suffix.
    infill: Infill | None = None
    tools: tuple[FunctionTool, ...] = ()
    tool_choice: ToolChoice = "auto"
    # None: not said, which is OpenAI's default, true: a reply may make several calls.
    # False: at most one (exactly one when a call is forced).
    parallel_tool_calls: bool | None = None
    # How the ids this server gives tool calls begin, as the API's own do (Anthropic's
    # "toolu_"). Given as the call is read, so the id a client sends back is the one the
    # next turn's prefill rendered (a template may render it).
    call_id_prefix: str = "call_"
    output: OutputFormat = TEXT
    # Temperature, top_p, stop, seed, penalties, ...: the pipeline makes each choice's
    # SamplingParams of them, with max_tokens and logprobs from the fields below.
    sampling: SamplingKnobs = field(default_factory=SamplingKnobs)
    # The knobs of `sampling` the client left unset (so at their defaults): a model's own
    # defaults (its table's `sampling`) replace them.
    unset_sampling: frozenset[str] = frozenset()
    # Text the answer is expected to be mostly like (OpenAI's Predicted Outputs): drafts
    # for speculative decoding ("": none).
    prediction: str = ""
    max_tokens: int | None = None  # None: the server's default, within the context window
    # max_tokens is only a cap, lowered to the server's max_output_tokens and to what the
    # context window leaves instead of refusing the request, and None means the rest of
    # the context window: the agent APIs' semantics (Claude Code asks for 32000; Codex
    # sends no max_output_tokens, and OpenAI's default is the rest of the window).
    fit_context: bool = False
    # A prompt too long for the context window keeps its first `keep_tokens` tokens (-1:
    # as many as fit) and as many of its last as leave half the rest of the window to the
    # reply, as Ollama's runner cuts it; None: it is a 400. One with images is not cut.
    keep_tokens: int | None = None
    # The request's own context window, within its model's (Ollama's num_ctx): its prompt
    # is truncated or refused as over it, and its reply ends where it is full. None: the
    # model's whole window.
    context_window: int | None = None
    n: int = 1  # choices per prompt
    # None: no logprobs; k: each content token's logprob plus its k likeliest alternatives.
    logprobs: int | None = None
    # Raw prompts only: each choice starts with its prompt's text, and with logprobs, its
    # prompt tokens' logprobs (computed whatever the cache holds).
    echo: bool = False
    stream: bool = False
    include_usage: bool = False  # a streamed response ends with the usage
    # A streamed response opens with the cache's share of the prompt too (Anthropic's
    # message_start): peeked before the engine starts, a round trip to an engine process
    # that only the responses which report it wait for.
    usage_at_start: bool = False
    # Template variables, e.g. {"enable_thinking": False}.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # How the rendered chat ends: "reply" opens the assistant's turn (the template's
    # generation prompt), "continue" leaves the final message open and the reply continues
    # it (an assistant prefill), "as_is" ends after the final message's own end.
    chat_end: ChatEnd = "reply"

    def token_limit(self, model_limit: int) -> int:
        """The most prompt + reply tokens this request may have: its model's
        `model_limit`, or fewer where its own context window says."""
        return model_limit if self.context_window is None else min(model_limit,
                                                                   self.context_window)

    @property
    def is_chat(self) -> bool:
        return bool(self.messages)

    @property
    def offered_tools(self) -> tuple[FunctionTool, ...]:
        """The tools the model may call: none when tool_choice is "none", the allowed
        ones under `AllowedTools`."""
        if isinstance(self.tool_choice, AllowedTools):
            return tuple(tool for tool in self.tools if tool.name in self.tool_choice.names)
        return () if self.tool_choice == "none" else self.tools
