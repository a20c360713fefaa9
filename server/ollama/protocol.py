"""Ollama's native API, as its clients send it: requests and responses.

Ollama's own `api/types.go` and its Python client (`ollama._types`) are the reference.
Its errors are `{"error": "..."}`; its streams are JSON lines, one object per line, the
last with `done: true` and the counts and durations (nanoseconds) of the whole reply.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator

from server.prefill.protocol import MAX_INPUTS
from server.schema import (
    MAX_TOP_LOGPROBS,
    ObjectSchema,
    RequestModel,
    ResponseModel,
    StopStrings,
    check_tool_names,
    shaped_union,
)

# The Ollama version this server answers /api/version with: clients check for a minimum
# (Copilot's and Open WebUI's look at it before they list models).
OLLAMA_VERSION = "0.12.0"


def go_integer(value: Any) -> Any:
    """An integer option as Ollama reads it: Go decodes JSON numbers as float64 and
    api.Options.FromMap truncates one to an integer (128.0 is 128, 40.7 is 40). Anything
    else is left for the strict int to take or refuse (true and "128" are 400s there too)."""
    if isinstance(value, float) and math.isfinite(value):
        return int(value)
    return value


GoInt = Annotated[int, BeforeValidator(go_integer)]
# Ollama's repeat_last_n where a request says none (api.DefaultOptions).
OLLAMA_REPEAT_LAST_N = 64


class Options(RequestModel):
    """The runtime options that mean something here; the rest (num_gpu, num_thread,
    mirostat, ...) are the machine's to choose, and ignored as Ollama ignores an option a
    model's runner does not use."""

    # No upper bound: Ollama has none (OpenAI's 2 is OpenAI's), and its users send more.
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: GoInt | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: GoInt | None = Field(None, ge=-1, lt=2**63)
    # Ollama's -1 is "until the context is full", -2 "fill the context", and Go clients
    # send 0 for unset: no cap, each of them.
    num_predict: GoInt | None = Field(None, ge=-2)
    repeat_penalty: float | None = Field(None, ge=0.01, le=10)
    # The last tokens repeat_penalty looks at (-1: the whole context, 0: none); llama.cpp's
    # sampler, which Ollama hands it to, refuses one under -1.
    repeat_last_n: GoInt = Field(OLLAMA_REPEAT_LAST_N, ge=-1)
    # The prompt's first tokens a truncation keeps (-1: as many as fit), as Ollama's.
    num_keep: GoInt = Field(4, ge=-1)
    # The request's context window, prompt and reply (the model's where larger): Ollama
    # loads its runner with it. No bound: Ollama's scheduler raises one under 4 to 4.
    num_ctx: GoInt | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stop: StopStrings | None = None

    @property
    def repetition_penalty(self) -> float | None:
        """Ollama's name for what the sampler calls a repetition penalty (1 is none)."""
        return self.repeat_penalty


# "json": any JSON value, as Ollama's JSON mode; an object: a JSON schema the reply follows.
Format = Literal["", "json"] | dict[str, Any]
# A level is the template's reasoning effort; "max" is Ollama's since 0.21.3.
Think = bool | Literal["low", "medium", "high", "max"]
# Go's duration units, in seconds: what Ollama's keep_alive strings are written in.
DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0,
                  "m": 60.0, "h": 3600.0}
DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def keep_alive_seconds(value: Any) -> float:
    """How long a model stays loaded after a request, in seconds, as Ollama reads
    keep_alive: a number of seconds or a Go duration ("5m", "1h30m"); negative: forever
    (inf). A bare number in a string is seconds too, as OLLAMA_KEEP_ALIVE takes it."""
    text = str(value).strip()  # a number's text is a number of seconds
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    try:
        seconds = sign * float(body)
    except ValueError:
        parts = DURATION_PART.findall(body)
        if not body or "".join(number + unit for number, unit in parts) != body:
            raise ValueError(f"not a duration: {text[:40]!r} (say \"5m\", \"1h\" or "
                             "a number of seconds)") from None
        seconds = sign * sum(float(number) * DURATION_UNITS[unit] for number, unit in parts)
    if math.isnan(seconds):
        raise ValueError("not a duration: nan")
    return math.inf if seconds < 0 else seconds


# A request's keep_alive, in seconds (inf: forever).
KeepAlive = Annotated[float, BeforeValidator(keep_alive_seconds)]


class CallFunction(RequestModel):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCall(RequestModel):
    id: str | None = None  # the id this server gave it, which a result may name
    function: CallFunction


class Message(RequestModel):
    # "thinking": a reply's thinking, as Continue sends it back (`chat_request`).
    role: Literal["system", "user", "assistant", "tool", "thinking"]
    content: str = ""
    thinking: str | None = None
    images: list[str] | None = None  # base64, as Ollama's clients send them
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None  # the tool a "tool" message answers
    tool_call_id: str | None = None  # the call it answers, by its id (newer clients)


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: ObjectSchema | None = None


class Tool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class GenerationFields(RequestModel):
    """What /api/chat and /api/generate share."""

    model: str = Field(min_length=1)
    format: Format | None = None
    options: Options | None = None
    stream: bool = True  # Ollama streams unless told not to
    keep_alive: KeepAlive | None = None
    # A prompt over the context window is truncated, as Ollama's: false refuses it.
    truncate: bool = True
    think: Think | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class ChatRequest(GenerationFields):
    messages: list[Message] = Field(default_factory=list)
    tools: list[Tool] | None = None

    @field_validator("tools")
    @classmethod
    def _tool_names_are_unique(cls, value: list[Tool] | None) -> list[Tool] | None:
        check_tool_names([tool.function.name for tool in value or ()])
        return value


class GenerateRequest(GenerationFields):
    prompt: str = ""
    system: str | None = None
    images: list[str] | None = None
    # The prompt as the model reads it: no chat template; its images where its [img-N]
    # tags are.
    raw: bool = False
    # Refused by name where set: ignoring them would answer another request than the one
    # sent (a fill-in-the-middle, another template, an earlier reply's token context).
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None


# Validated by its shape (server.schema.shaped_union): a bad input gets one error.
EmbedInput = shaped_union(
    lambda value: "text" if isinstance(value, str) else "texts" if isinstance(value, list)
    else None, "a string or a list of strings",
    text=str, texts=Annotated[list[str], Field(max_length=MAX_INPUTS)])


class EmbedRequest(RequestModel):
    model: str = Field(min_length=1)
    # None, "" or []: load the model, as Ollama does; as many texts as /v1/embeddings takes.
    input: EmbedInput = ""
    truncate: bool = True
    dimensions: int | None = None  # Ollama ignores one that is not positive
    options: Options | None = None
    keep_alive: KeepAlive | None = None


class EmbeddingsRequest(RequestModel):
    """The older /api/embeddings: one prompt, one embedding (none or "": load the model;
    Ollama's Python client leaves out a prompt it is not given)."""

    model: str = Field(min_length=1)
    prompt: str = ""
    options: Options | None = None
    keep_alive: KeepAlive | None = None


class ShowRequest(RequestModel):
    model: str | None = None
    name: str | None = None  # the field's older name, which clients still send
    verbose: bool = False


# -- responses ---------------------------------------------------------------------------


class ModelDetails(ResponseModel):
    parent_model: str = ""
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class ListedModel(ResponseModel):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails


class ModelList(ResponseModel):
    models: list[ListedModel]


class RunningModel(ListedModel):
    expires_at: str
    size_vram: int
    context_length: int


class RunningModels(ResponseModel):
    models: list[RunningModel]


class ShowResponse(ResponseModel):
    license: str = ""
    modelfile: str
    parameters: str
    template: str
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class Version(ResponseModel):
    version: str


class OutCall(ResponseModel):
    id: str
    function: dict[str, Any]  # {"index", "name", "arguments": object}


class OutMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str = ""
    thinking: str | None = None
    tool_calls: list[OutCall] | None = None


class Timings(ResponseModel):
    """The last object's counts and durations, in nanoseconds as Ollama's."""

    # load and unload: what an empty request did (the model loaded, or unloaded).
    done_reason: Literal["stop", "length", "load", "unload"] | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class TokenLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]  # the token's own bytes: part of a character where it holds only part


class Logprob(TokenLogprob):
    top_logprobs: list[TokenLogprob] | None = None


class ChatChunk(Timings):
    model: str
    created_at: str
    message: OutMessage
    done: bool
    logprobs: list[Logprob] | None = None  # the answer tokens' behind this object's text


class GenerateChunk(Timings):
    model: str
    created_at: str
    response: str
    thinking: str | None = None
    done: bool
    logprobs: list[Logprob] | None = None


class EmbedResponse(ResponseModel):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int = 0
    prompt_eval_count: int


class EmbeddingsResponse(ResponseModel):
    embedding: list[float]


class ErrorResponse(ResponseModel):
    error: str
