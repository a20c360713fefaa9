"""The neutral stream of events one generation produces, whatever API asked for it.

`server.pipeline` turns engine tokens into these; each front end renders them in its own
shapes (OpenAI chunks, Responses events, Anthropic content blocks), and `collect` folds
them into whole choices for non-streaming responses, so streamed and whole answers are
built from the same events and cannot disagree.

Per choice the order is: any mix of `TextDelta`, `ReasoningDelta` and tool calls (each
`ToolCallStarted` followed by its `ToolCallArguments` fragments, calls one after another,
numbered from 0), then exactly one `ChoiceFinished`. Choices interleave.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

from engine.api import CacheMiss, TokenEvent

# stop: the model ended (EOS or a stop sequence); length: max_tokens reached;
# tool_calls: it ended after calling tools.
FinishReason = Literal["stop", "length", "tool_calls"]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Prompt tokens the radix cache already held (not computed again).
    cached_tokens: int = 0
    # Completion tokens spent thinking; None: the model does not reason.
    reasoning_tokens: int | None = None
    # Tokens drafted from the request's prediction (OpenAI's Predicted Outputs), and of
    # those, the ones the model agreed with.
    prediction_tokens: int = 0
    accepted_prediction_tokens: int = 0
    # Where the cache stopped matching the prompt and why, when the response reports it.
    cache_miss: CacheMiss | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TextDelta:
    """Answer text. `tokens` are the generated tokens behind it, with logprobs when they
    were asked for (it may be empty text while a token's text is still held back)."""

    choice: int
    text: str
    tokens: tuple[TokenEvent, ...] = ()


@dataclass(frozen=True)
class ReasoningDelta:
    """Thinking text (between the model's thinking markers): never part of the answer."""

    choice: int
    text: str


@dataclass(frozen=True)
class ToolCallStarted:
    """Call number `index` of this choice begins: its id and function name are known."""

    choice: int
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    """The next piece of call `index`'s arguments (JSON text; the pieces concatenate to
    the whole arguments object)."""

    choice: int
    index: int
    fragment: str


@dataclass(frozen=True)
class ChoiceFinished:
    """The choice is complete. `usage` is this choice's own (its prompt counted once);
    `matched_stop` is the stop string or token id that ended it, if any."""

    choice: int
    reason: FinishReason
    usage: Usage
    matched_stop: str | int | None = None


Event = TextDelta | ReasoningDelta | ToolCallStarted | ToolCallArguments | ChoiceFinished


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""
    after_text: int = 0  # how much of its choice's text came before it


@dataclass
class ChoiceResult:
    """A whole choice, for non-streaming responses."""

    text: str = ""
    reasoning: str = ""
    tokens: list[TokenEvent] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: FinishReason = "stop"
    matched_stop: str | int | None = None
    usage: Usage = Usage()


async def collect(events: AsyncIterator[Event], choices: int) -> list[ChoiceResult]:
    """Fold a generation's events into its `choices` whole choices."""
    results = [ChoiceResult() for _ in range(choices)]
    async for event in events:
        fold(results[event.choice], event)
    return results


def fold(result: ChoiceResult, event: Event) -> None:
    """Add one of its choice's events to `result`."""
    if isinstance(event, TextDelta):
        result.text += event.text
        result.tokens += event.tokens
    elif isinstance(event, ReasoningDelta):
        result.reasoning += event.text
    elif isinstance(event, ToolCallStarted):
        result.tool_calls.append(ToolCall(event.id, event.name, after_text=len(result.text)))
    elif isinstance(event, ToolCallArguments):
        result.tool_calls[event.index].arguments += event.fragment
    else:
        result.finish_reason, result.matched_stop = event.reason, event.matched_stop
        result.usage = event.usage
