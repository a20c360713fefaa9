"""Deltas and finished choices rendered as OpenAI's chat and legacy completion objects.

Both formats answer the same four questions (the chunks that open a stream, the chunk for
one delta, the closing usage chunk, the whole response), so the routes drive them the
same way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from engine.api import TokenEvent, TokenLogprob
from server.jobs import ChoiceResult, Delta
from server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    ToolCallDelta,
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


def legacy_logprobs(tokens: Sequence[TokenEvent], offset: int) -> CompletionLogprobs:
    """`offset` is where the first token's text starts in the choice's text."""
    scored = [token for token in tokens if token.logprob is not None]
    offsets = []
    for token in scored:
        offsets.append(offset)
        offset += len(token.logprob.text)
    return CompletionLogprobs(
        tokens=[token.logprob.text for token in scored],
        token_logprobs=[token.logprob.logprob for token in scored],
        top_logprobs=[
            {alternative.text: alternative.logprob for alternative in token.top_logprobs}
            for token in scored
        ],
        text_offset=offsets,
    )


class Format:
    """Shared by both formats: ids, the creation time, and the chunk envelope."""

    chunk_type: type[ChatCompletionChunk | CompletionResponse]

    def __init__(self, response_id: str, model: str, logprobs: bool) -> None:
        self.response_id, self.model, self.logprobs = response_id, model, logprobs
        self.created = now()

    def _chunk(self, choices: list, usage: Usage | None = None):
        return self.chunk_type(
            id=self.response_id, created=self.created, model=self.model, choices=choices,
            usage=usage,
        )

    def usage_chunk(self, usage: Usage):
        """The extra last chunk of `stream_options.include_usage`: no choices, usage."""
        return self._chunk([], usage)


class ChatFormat(Format):
    chunk_type = ChatCompletionChunk

    def __init__(self, response_id: str, model: str, logprobs: bool) -> None:
        super().__init__(response_id, model, logprobs)
        self._tool_calls_sent: Counter[int] = Counter()

    def opening_chunks(self, choices: int) -> list[ChatCompletionChunk]:
        """OpenAI opens every choice with the role and empty content."""
        opening = DeltaMessage(role="assistant", content="")
        return [self._chunk([ChatChunkChoice(index=i, delta=opening)]) for i in range(choices)]

    def chunk(self, delta: Delta) -> ChatCompletionChunk | None:
        logprobs = chat_logprobs(delta.tokens) if self.logprobs and delta.tokens else None
        if not (delta.text or delta.tool_calls or logprobs or delta.finish_reason):
            return None
        sent = self._tool_calls_sent[delta.index]
        tool_calls = [
            ToolCallDelta(index=sent + i, **call.model_dump())
            for i, call in enumerate(delta.tool_calls)
        ]
        self._tool_calls_sent[delta.index] += len(tool_calls)
        return self._chunk([
            ChatChunkChoice(
                index=delta.index,
                delta=DeltaMessage(content=delta.text or None, tool_calls=tool_calls or None),
                logprobs=logprobs,
                finish_reason=delta.finish_reason,
            )
        ])

    def response(self, results: list[ChoiceResult], usage: Usage) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=self.response_id,
            model=self.model,
            created=self.created,
            choices=[
                ChatChoice(
                    index=i,
                    message=ChatMessage(
                        # OpenAI gives null content to a reply that is only tool calls.
                        content=result.text or (None if result.tool_calls else ""),
                        tool_calls=result.tool_calls,
                    ),
                    logprobs=chat_logprobs(result.tokens) if self.logprobs else None,
                    finish_reason=result.finish_reason,
                )
                for i, result in enumerate(results)
            ],
            usage=usage,
        )


class CompletionFormat(Format):
    chunk_type = CompletionResponse

    def __init__(self, response_id: str, model: str, logprobs: bool) -> None:
        super().__init__(response_id, model, logprobs)
        # Per choice, where the next token's text starts (legacy `text_offset`).
        self._offsets: Counter[int] = Counter()

    def opening_chunks(self, choices: int) -> list[CompletionResponse]:
        return []

    def chunk(self, delta: Delta) -> CompletionResponse | None:
        logprobs = None
        if self.logprobs and delta.tokens:
            logprobs = legacy_logprobs(delta.tokens, self._offsets[delta.index])
            self._offsets[delta.index] += sum(len(token) for token in logprobs.tokens)
        if not (delta.text or logprobs or delta.finish_reason):
            return None
        return self._chunk([
            CompletionChoice(
                index=delta.index, text=delta.text, logprobs=logprobs,
                finish_reason=delta.finish_reason,
            )
        ])

    def response(self, results: list[ChoiceResult], usage: Usage) -> CompletionResponse:
        return self._chunk(
            [
                CompletionChoice(
                    index=i,
                    text=result.text,
                    logprobs=legacy_logprobs(result.tokens, 0) if self.logprobs else None,
                    finish_reason=result.finish_reason,
                )
                for i, result in enumerate(results)
            ],
            usage,
        )
