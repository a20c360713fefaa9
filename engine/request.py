"""What crosses the boundary between the engine and its callers.

The server builds a `SamplingParams`, calls `Engine.submit`, and reads `TokenEvent`s
followed by one `Finish` from the returned stream. Nothing here imports MLX, so the
server can use these types without touching arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding options, already validated by the caller."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # None: no logprobs. 0..20: the sampled token's logprob plus that many alternatives.
    logprobs: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    text: str
    logprob: float


@dataclass(frozen=True)
class TokenEvent:
    """One generated token and the text it made visible (may be empty while a
    multi-byte character or a possible stop string is held back)."""

    token: int
    text: str
    logprob: TokenLogprob | None = None
    top_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finish:
    """The last event of every successful stream."""

    reason: FinishReason
    text: str  # any held-back text released at the end
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Stop string or stop token id that ended the stream, if any.
    matched_stop: str | int | None = None


class EngineError(Exception):
    """Base class of the errors the engine reports to callers."""


class EngineNotReady(EngineError):
    """The model is still loading or failed to load."""


class QueueFull(EngineError):
    """Too many requests are waiting; the caller should retry later."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ContextLengthExceeded(EngineError):
    """prompt + max_tokens does not fit in the model's context window."""


class RequestFailed(EngineError):
    """The engine failed this one request (for example its forward pass raised)."""
