"""LM Studio's own REST API, as its docs define it (lmstudio.ai/docs/developer/rest):
requests and responses.

v0's bodies are OpenAI's, with LM Studio's `max_tokens: -1` for "no limit"; its answers
are OpenAI's objects with `stats`, `model_info` and `runtime` beside them, and its
errors OpenAI's error object. v1's chat and model management have shapes and errors of
their own.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from server.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
)
from server.schema import RequestModel, ResponseModel, shaped_union, str_or_list, type_of

# Why a reply ended, in LM Studio's words (its SDK's LLMPredictionStopReason).
StopReason = Literal["eosFound", "stopStringFound", "maxPredictedTokensReached", "toolCalls"]


def _unlimited(value: Any) -> Any:
    """LM Studio's -1 is no limit on the reply, as an absent max_tokens is here."""
    return None if value == -1 else value


class ChatRequest(ChatCompletionRequest):
    _max_tokens = field_validator("max_tokens", mode="before")(_unlimited)


class TextRequest(CompletionRequest):
    _max_tokens = field_validator("max_tokens", mode="before")(_unlimited)


class ModelEntry(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    type: Literal["llm", "vlm", "embeddings"]
    publisher: str
    arch: str
    compatibility_type: Literal["mlx", "gguf"]
    quantization: str
    state: Literal["loaded", "not-loaded"]
    max_context_length: int | None  # None: no config known yet (a hub id), or an encoder not loaded
    capabilities: list[Literal["tool_use"]]


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelEntry]


class Stats(ResponseModel):
    tokens_per_second: float
    time_to_first_token: float  # seconds, from the request's arrival
    generation_time: float  # seconds, from the first token to the end
    stop_reason: StopReason


class ModelInfo(ResponseModel):
    arch: str
    quant: str
    format: Literal["mlx", "gguf"]
    context_length: int | None


class Runtime(ResponseModel):
    name: str
    version: str
    supported_formats: list[str]


class Extras(ResponseModel):
    """What LM Studio's answers add to OpenAI's."""

    stats: Stats
    model_info: ModelInfo
    runtime: Runtime


class ChatCompletion(Extras, ChatCompletionResponse):
    pass


class Completion(Extras, CompletionResponse):
    pass


# -- v1 (LM Studio 0.4's management endpoints) ------------------------------------------


class V1Error(ResponseModel):
    type: Literal["invalid_request", "model_not_found", "not_implemented", "internal_error"]
    message: str
    code: str | None = None
    param: str | None = None


class V1ErrorResponse(ResponseModel):
    error: V1Error


class Quantization(ResponseModel):
    name: str | None
    bits_per_weight: int | None


class InstanceConfig(ResponseModel):
    context_length: int | None


class Instance(ResponseModel):
    id: str
    config: InstanceConfig


class Capabilities(ResponseModel):
    vision: bool
    trained_for_tool_use: bool


class EmbeddingModel(ResponseModel):
    type: Literal["embedding"] = "embedding"
    publisher: str
    key: str
    display_name: str
    quantization: Quantization | None
    size_bytes: int
    params_string: str | None
    loaded_instances: list[Instance]
    max_context_length: int | None
    format: Literal["gguf", "mlx"] | None


class LanguageModel(EmbeddingModel):
    """An LLM's entry: an embedding model's, with what only an LLM has."""

    type: Literal["llm"] = "llm"  # type: ignore[assignment]
    architecture: str | None
    capabilities: Capabilities
    description: str | None = None


class V1ModelList(ResponseModel):
    models: list[LanguageModel | EmbeddingModel]


class LoadRequest(RequestModel):
    """LM Studio's load options beside `model` are its engines' (context length, batch
    size, flash attention, experts, KV offload): ours are the server's configuration, so
    they are ignored, and `echo_load_config` says what the model has."""

    model: str
    echo_load_config: bool = False


class LoadConfig(ResponseModel):
    context_length: int | None


class Loaded(ResponseModel):
    type: Literal["llm", "embedding"]
    instance_id: str
    load_time_seconds: float
    status: Literal["loaded"] = "loaded"
    load_config: LoadConfig | None = None


class UnloadRequest(RequestModel):
    instance_id: str


class Unloaded(ResponseModel):
    instance_id: str


# -- v1 chat (POST /api/v1/chat) -------------------------------------------------------------


class MessageInput(RequestModel):
    type: Literal["message"]
    content: str


class ImageInput(RequestModel):
    type: Literal["image"]
    data_url: str


# Validated by their shape (server.schema.shaped_union): a bad input gets one error.
InputItem = shaped_union(lambda value: type_of(value, ("message", "image")),
                         'a "message" or an "image" item', message=MessageInput, image=ImageInput)
ChatInput = shaped_union(str_or_list, "a string or a list of message and image items",
                         str=str, list=Annotated[list[InputItem], Field(min_length=1)])
# "on": the model's own default effort; the levels as gpt-oss's templates read them.
Reasoning = Literal["off", "low", "medium", "high", "on"]


class V1ChatRequest(RequestModel):
    """One user turn: `input` (text, or text and images in order), after the stored
    conversation `previous_response_id` names. `integrations` (LM Studio's plugins and
    MCP servers) run tools in LM Studio's process, which this server does not."""

    model: str
    input: ChatInput
    system_prompt: str | None = None
    integrations: list[Any] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repeat_penalty: float | None = Field(None, gt=0)
    max_output_tokens: int | None = Field(None, ge=1)
    reasoning: Reasoning | None = None
    context_length: int | None = Field(None, ge=1)
    store: bool = True
    previous_response_id: str | None = None

    @property
    def repetition_penalty(self) -> float | None:
        """LM Studio's name for what the sampler calls a repetition penalty (1 is none)."""
        return self.repeat_penalty


class OutputText(ResponseModel):
    type: Literal["message", "reasoning"]
    content: str


class ChatStats(ResponseModel):
    input_tokens: int
    total_output_tokens: int
    reasoning_output_tokens: int
    tokens_per_second: float
    time_to_first_token_seconds: float
    model_load_time_seconds: float | None = None  # only where the request loaded it


class V1ChatResult(ResponseModel):
    model_instance_id: str
    output: list[OutputText]
    stats: ChatStats
    response_id: str | None = None  # none unless stored

