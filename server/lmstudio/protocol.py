"""LM Studio's own REST API (v0), as its docs (lmstudio.ai/docs/developer/rest/endpoints)
define it: requests and responses.

Its bodies are OpenAI's, with LM Studio's `max_tokens: -1` for "no limit"; its answers
are OpenAI's objects with `stats`, `model_info` and `runtime` beside them, and its
errors OpenAI's error object.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator

from server.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
)
from server.schema import ResponseModel

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
    max_context_length: int | None  # None: never loaded, and its config names none
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
