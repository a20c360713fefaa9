"""The neutral events of a generation rendered as OpenAI's chat and legacy completion
objects.

Both formats answer the same four questions (the chunks that open a stream, the chunk for
one event, the closing usage chunk, the whole response), so the routes drive them the
same way.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import asdict
from typing import Literal

from pydantic_core import to_json

from engine.api import TokenEvent, TokenLogprob
from server.custom_tools import InputReader, custom_input
from server.events import (
    ChoiceFinished,
    ChoiceResult,
    Event,
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallStarted,
)
from server.events import ToolCall as NeutralToolCall
from server.events import Usage as NeutralUsage
from server.openai.protocol import (
    CacheMissDetails,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionTokensDetails,
    CustomCallDelta,
    CustomCallOut,
    CustomToolCallOut,
    DeltaMessage,
    FunctionCallDelta,
    FunctionCallOut,
    PromptTokensDetails,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
    now,
)


def _top(logprob: TokenLogprob) -> TopLogprob:
    return TopLogprob(
        token=logprob.text, logprob=logprob.logprob, bytes=list(logprob.bytes)
    )


def chat_logprobs(tokens: Sequence[TokenEvent]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                **_top(token.logprob).model_dump(),
                top_logprobs=[_top(alternative) for alternative in token.top_logprobs],
            )
            for token in tokens
            if token.logprob is not None
        ]
    )


class TextOffsets:
    """Where each token of a choice starts in its text (legacy `text_offset`), counted in
    the text's characters from the tokens' bytes: a token holding part of a character
    starts at that character. (Counted from the tokens' own texts, each part of a split
    character was a U+FFFD of its own, and a reply of emoji had offsets past its end.)"""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._characters = 0

    def starts(self, tokens: Sequence[TokenEvent]) -> list[int]:
        offsets = []
        for token in tokens:
            offsets.append(self._characters)
            own = token.text.encode() if token.logprob is None else token.logprob.bytes
            self._characters += len(self._decoder.decode(own))
        return offsets


def legacy_logprobs(tokens: Sequence[TokenEvent], offsets: TextOffsets) -> CompletionLogprobs:
    """`offsets`: the choice's, up to these tokens. A token without a logprob (an echoed
    prompt's first) gets nulls, as OpenAI's and vLLM's."""
    texts = [token.text if token.logprob is None else token.logprob.text for token in tokens]
    return CompletionLogprobs(
        tokens=texts,
        token_logprobs=[None if token.logprob is None else token.logprob.logprob
                        for token in tokens],
        top_logprobs=[
            None if token.logprob is None else
            {alternative.text: alternative.logprob for alternative in token.top_logprobs}
            for token in tokens
        ],
        text_offset=offsets.starts(tokens),
    )

# Stands for a text delta's text in the chunk made once per choice to cut its envelope from.
TEXT_MARK = "\x00text\x00"


class Format:
    """Shared by both formats: ids, the creation time, and the chunk envelope."""

    chunk_type: type[ChatCompletionChunk | CompletionResponse]

    def __init__(self, response_id: str, model: str, logprobs: bool) -> None:
        self.response_id, self.model, self.logprobs = response_id, model, logprobs
        self.created = now()
        # Fields every chunk carries beside the common ones (a format's own).
        self.chunk_fields: dict[str, object] = {}
        # (choice, excluded fields) -> the JSON of a text chunk before and after its text.
        self._text_envelopes: dict[tuple[int, frozenset[str]], tuple[str, str]] = {}

    def chunk_json(self, event: Event, exclude: frozenset[str] = frozenset()) -> str | None:
        """`chunk(event)` as JSON, without the fields in `exclude`. Text without logprobs,
        the chunk of almost every token, is written into its choice's envelope, cut once
        from a real chunk: building and dumping the models took ~30 µs of the event
        loop's time per token on the 2-core CPU, which 64 streams paid 64 times a step."""
        if isinstance(event, TextDelta) and event.text and not (self.logprobs and event.tokens):
            key = (event.choice, exclude)
            if key not in self._text_envelopes:
                marked = self.chunk(TextDelta(event.choice, TEXT_MARK))
                before, after = marked.model_dump_json(exclude=exclude).split(
                    to_json(TEXT_MARK).decode())
                self._text_envelopes[key] = before, after
            before, after = self._text_envelopes[key]
            return before + to_json(event.text).decode() + after
        chunk = self.chunk(event)
        return None if chunk is None else chunk.model_dump_json(exclude=exclude)

    def _chunk(self, choices: list, usage: Usage | None = None):
        return self.chunk_type(
            id=self.response_id, created=self.created, model=self.model, choices=choices,
            usage=usage, **self.chunk_fields,
        )

    def usage_chunk(self, usage: NeutralUsage):
        """The extra last chunk of `stream_options.include_usage`: no choices, usage."""
        return self._chunk([], openai_usage(usage))


def openai_usage(usage: NeutralUsage) -> Usage:
    return Usage(
        prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=usage.cached_tokens,
            cache_miss=usage.cache_miss and CacheMissDetails(**asdict(usage.cache_miss))),
        completion_tokens_details=CompletionTokensDetails(
            reasoning_tokens=usage.reasoning_tokens or 0,
            accepted_prediction_tokens=usage.accepted_prediction_tokens,
            rejected_prediction_tokens=usage.prediction_tokens - usage.accepted_prediction_tokens),
    )


class ChatFormat(Format):
    chunk_type = ChatCompletionChunk

    def __init__(self, response_id: str, model: str, logprobs: bool,
                 calls_only: bool = False, custom_tools: frozenset[str] = frozenset(),
                 tier_asked: bool = False) -> None:
        """`calls_only`: the reply is tool calls the request forces, with no content.
        `custom_tools`: the names of the request's custom tools, whose calls are custom
        calls with their input, not function calls with arguments. `tier_asked`: the
        request named a service tier, so the response says the one that served it."""
        super().__init__(response_id, model, logprobs)
        self.calls_only, self.custom_tools = calls_only, custom_tools
        self.service_tier: Literal["default"] | None = "default" if tier_asked else None
        self.chunk_fields = {"service_tier": self.service_tier}
        self._inputs: dict[int, tuple[int, InputReader]] = {}  # choice -> its open custom call

    def opening_chunks(self, choices: int) -> list[ChatCompletionChunk]:
        """OpenAI opens every choice with the role and empty content; a reply that can only
        be tool calls without content (null, as the whole response gives it): an SDK that
        adds the deltas up would otherwise hold "" where the response holds null."""
        opening = DeltaMessage(role="assistant", content=None if self.calls_only else "")
        return [self._chunk([ChatChunkChoice(index=i, delta=opening)]) for i in range(choices)]

    def chunk(self, event: Event) -> ChatCompletionChunk | None:
        delta, logprobs, finish_reason = DeltaMessage(), None, None
        if isinstance(event, TextDelta):
            if self.logprobs and event.tokens:
                logprobs = chat_logprobs(event.tokens)
            elif not event.text:
                return None
            delta.content = event.text or None
        elif isinstance(event, ReasoningDelta):
            delta.reasoning_content = event.text
        elif isinstance(event, ToolCallStarted):
            delta.tool_calls = self._close_input(event.choice) + [self._started(event)]
        elif isinstance(event, ToolCallArguments):
            if event.choice not in self._inputs:
                delta.tool_calls = [ToolCallDelta(
                    index=event.index, function=FunctionCallDelta(arguments=event.fragment))]
            elif text := self._inputs[event.choice][1].feed(event.fragment):
                delta.tool_calls = [ToolCallDelta(index=event.index,
                                                  custom=CustomCallDelta(input=text))]
            else:
                return None
        else:
            delta.tool_calls = self._close_input(event.choice) or None
            finish_reason = event.reason
        return self._chunk([ChatChunkChoice(
            index=event.choice, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
        )])

    def _started(self, event: ToolCallStarted) -> ToolCallDelta:
        if event.name not in self.custom_tools:
            return ToolCallDelta(index=event.index, id=event.id, type="function",
                                 function=FunctionCallDelta(name=event.name, arguments=""))
        self._inputs[event.choice] = event.index, InputReader()
        return ToolCallDelta(index=event.index, id=event.id, type="custom",
                             custom=CustomCallDelta(name=event.name, input=""))

    def _close_input(self, choice: int) -> list[ToolCallDelta]:
        """The end of the choice's open custom call: what its input held back."""
        if choice not in self._inputs:
            return []
        index, reader = self._inputs.pop(choice)
        text = reader.finish()
        return [ToolCallDelta(index=index, custom=CustomCallDelta(input=text))] if text else []

    def _call(self, call: NeutralToolCall) -> ToolCallOut | CustomToolCallOut:
        if call.name in self.custom_tools:
            return CustomToolCallOut(id=call.id, custom=CustomCallOut(
                name=call.name, input=custom_input(call.arguments)))
        return ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name,
                                                                arguments=call.arguments))

    def response(self, results: list[ChoiceResult], usage: NeutralUsage) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=self.response_id,
            model=self.model,
            created=self.created,
            choices=[
                ChatChoice(
                    index=i,
                    message=ChatCompletionMessage(
                        # OpenAI gives null content to a reply that is only tool calls
                        # (a model may put blank lines around them).
                        content=None if result.tool_calls and not result.text.strip()
                        else result.text,
                        reasoning_content=result.reasoning or None,
                        tool_calls=[self._call(call) for call in result.tool_calls],
                    ),
                    logprobs=chat_logprobs(result.tokens) if self.logprobs else None,
                    finish_reason=result.finish_reason,
                )
                for i, result in enumerate(results)
            ],
            usage=openai_usage(usage),
            service_tier=self.service_tier,
        )


class CompletionFormat(Format):
    chunk_type = CompletionResponse

    def __init__(self, response_id: str, model: str, logprobs: bool) -> None:
        super().__init__(response_id, model, logprobs)
        # Per choice, where its tokens' texts start (legacy `text_offset`).
        self._offsets: dict[int, TextOffsets] = {}

    def opening_chunks(self, choices: int) -> list[CompletionResponse]:
        return []

    def chunk(self, event: Event) -> CompletionResponse | None:
        # Raw prompts have no reasoning or tool calls: text and the finish only.
        text = event.text if isinstance(event, TextDelta) else ""
        finish_reason = event.reason if isinstance(event, ChoiceFinished) else None
        logprobs = None
        if self.logprobs and isinstance(event, TextDelta) and event.tokens:
            offsets = self._offsets.setdefault(event.choice, TextOffsets())
            logprobs = legacy_logprobs(event.tokens, offsets)
        if not (text or logprobs or finish_reason):
            return None
        return self._chunk([
            CompletionChoice(
                index=event.choice, text=text, logprobs=logprobs, finish_reason=finish_reason,
            )
        ])

    def response(self, results: list[ChoiceResult], usage: NeutralUsage) -> CompletionResponse:
        return self._chunk(
            [
                CompletionChoice(
                    index=i,
                    text=result.text,
                    logprobs=(legacy_logprobs(result.tokens, TextOffsets())
                              if self.logprobs else None),
                    finish_reason=result.finish_reason,
                )
                for i, result in enumerate(results)
            ],
            openai_usage(usage),
        )


class FimFormat(ChatFormat):
    """Mistral's fill in the middle, answered in Chat Completions' shapes as Mistral
    answers it: its finishing chunk's delta holds an empty `content`, as Mistral's does,
    for clients that add up every chunk's `delta.content` (Continue's Mistral provider)."""

    def chunk(self, event: Event) -> ChatCompletionChunk | None:
        chunk = super().chunk(event)
        if isinstance(event, ChoiceFinished) and chunk is not None:
            delta = chunk.choices[0].delta
            delta.content = delta.content or ""
        return chunk
