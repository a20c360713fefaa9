"""One request's engine-side state: how it samples, what it has generated, its text, its
hold on the radix tree, and what a generated token does to it.

`Generation.__init__` is where a request's sampling is set up (sampler, penalties,
stop tokens); `Generation.accept` is where each generated token is taken in
(its constraint, stop tokens, text, stop strings, max_tokens). The constraint's matcher
lives with the generator's sequence (the generator feeds it every token before masking
the next); the scheduler builds it at each admission (`Grammars.state`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from engine.api import (
    CacheMiss,
    ConstraintUnmet,
    Finish,
    FinishReason,
    PromptImage,
    RequestFailed,
    SamplingParams,
    TokenEvent,
)
from engine.generator import SequenceState
from engine.grammar import ConstraintFailed
from engine.image_tokens import text_ids
from engine.readout import last_position
from engine.sampling import make_penalties, make_sampler, token_logprobs
from engine.speculation import Drafts
from engine.text import TextStream
from engine.tokenizer import ModelTokenizer
from engine.tree_hold import TreeHold
from engine.vision import Pixels
from radix import Miss, RadixTree

# Prompt tokens on each side of a cache miss that its description shows.
MISS_CONTEXT = 12


class Generation:
    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams,
                 emit: Callable[[object], None], tokenizer: ModelTokenizer, vocab_size: int,
                 tree: RadixTree, on_dequeue: Callable[[], None] | None = None,
                 message_ends: tuple[int, ...] = (),
                 images: tuple[PromptImage, ...] = (), owner: str | None = None) -> None:
        self.id = request_id
        # The client request it is part of (one of its n choices, or of its prompts):
        # admission shares the batch among requests, not generations (admission.py).
        self.owner = owner or request_id
        self.prompt = prompt
        self.images = images  # see api.Prompt
        # The pixels of the images its prefill computes, by index, prepared off the loop
        # before admission (`Scheduler._preparing_images`).
        self.pixels: dict[int, Pixels] = {}
        self.params = params
        self._emit = emit
        self._on_dequeue = on_dequeue
        self._tokenizer = tokenizer
        # A readout shows no text (a classify list makes 64 of these on the event loop).
        self.text = None if params.readout is not None else TextStream(
            tokenizer, text_ids(prompt) if images else prompt, params.stop,
            params.min_tokens)
        self.sampler = make_sampler(params, vocab_size)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= tokenizer.eos_token_ids
        self.stop_ids = frozenset(stop_ids)
        self.penalties = make_penalties(params, len(prompt), self.stop_ids)
        # The tokens fed as this request's prompt: the prompt, or after a failed step or a
        # preemption the prompt plus what was generated before it.
        self.tokens = prompt
        self.message_ends = message_ends  # see api.Prompt
        # Whole-state snapshots prefill took at message ends, (position, handle), until
        # the prompt is published with them.
        self.snapshots: list[tuple[int, Any]] = []
        self.generated: list[int] = []
        self.cached_tokens: int | None = None  # radix hit at first admission
        self.cache_miss: Miss | None = None  # and why it was not longer
        self.hold = TreeHold(tree)
        self.sequence: SequenceState | None = None  # the generator's side, while running
        self.prompt_done = False
        self.passed_over = 0  # admission rounds that started others but not this one
        self.suspect = False  # was in a failed step; runs alone until it succeeds
        # Computing its prompt without a reservation: requests sharing it follow it (see
        # scheduler.py, "Sharing a prefix being computed").
        self.publishing = False
        self.followers: list[Generation] = []
        self.drafts: Drafts | None = None  # speculative decoding's, see Scheduler._drafts
        self._waiting = WaitingTokens()

    @property
    def background(self) -> bool:
        """Work no client waits on: a prompt computed only to be cached (a chat's next
        turn, `Readout.cache_only`)."""
        readout = self.params.readout
        return readout is not None and readout.cache_only

    @property
    def cacheable(self) -> list[int]:
        """The tokens whose KV can come from the tree, and goes to it once computed: all
        but the last, which must run to give the first logits; a readout's first
        `cached_prefix` at most."""
        readout = self.params.readout
        if readout is not None and readout.cached_prefix is not None:
            return self.tokens[:min(readout.cached_prefix, len(self.tokens) - 1)]
        return self.tokens[:-1]

    # -- events -----------------------------------------------------------------------

    def dequeue(self) -> None:
        """Report, once, that this request no longer counts against the queue limit."""
        if self._on_dequeue is not None:
            on_dequeue, self._on_dequeue = self._on_dequeue, None
            on_dequeue()

    def emit(self, event: object) -> None:
        self.dequeue()  # a request that ends before admission leaves the queue too
        self._emit(event)

    def accept(self, token: int, logprobs: Any) -> tuple[FinishReason, str | int | None] | None:
        """Take in a generated token (with its log-distribution, when asked for) and emit
        what it shows; returns (reason, matched stop) when it ends the generation. Raises
        ConstraintFailed when the constraint's matcher failed at this token."""
        grammar = self.sequence.grammar
        if grammar is not None and grammar.error is not None:
            raise ConstraintFailed(grammar.error)
        if self.params.readout is not None:  # prefill only: what the prompt's end gives
            if not self.params.readout.cache_only:
                self.emit(last_position(logprobs, token, self._tokenizer))
            return "length", None
        if self.params.max_tokens == 0:  # the prompt alone (scored): no token is kept
            return "length", None
        self.generated.append(token)
        self.suspect = False
        if token in self.stop_ids:  # a stop token: never shown as text
            return "stop", token
        start = self.text.decoded
        text = self.text.add(token)
        if self.params.logprobs is None:
            self.emit(TokenEvent(token, text))
        else:
            event = TokenEvent(token, text, *token_logprobs(logprobs, token, self._tokenizer))
            stopped = self.text.matched_stop is not None
            for ready in self._waiting.add(event, start, self.text.shown, stopped):
                self.emit(ready)
        if self.text.matched_stop is not None:
            return "stop", self.text.matched_stop
        if grammar is not None and grammar.complete_after(len(self.generated)):
            return "stop", None
        if len(self.generated) >= self.params.max_tokens:
            return "length", None
        return None

    def finish(self, reason: FinishReason, matched_stop: str | int | None = None) -> None:
        """Emit the last event, with any text still held back (none after a cancel)."""
        tail = "" if reason == "cancelled" or self.text is None else self.text.finish()
        events, tail = self._waiting.end(tail)
        for event in events:
            self.emit(event)
        drafts = self.drafts
        self.emit(Finish(reason, tail, len(self.prompt), len(self.generated),
                         self.cached_tokens or 0, matched_stop, self._described_miss(),
                         drafts.drafted if drafts else 0, drafts.accepted if drafts else 0,
                         drafts.predicted if drafts else 0,
                         drafts.accepted_predicted if drafts else 0))

    def _described_miss(self) -> CacheMiss | None:
        miss = self.cache_miss
        if miss is None:
            return None
        at = miss.position

        def decode(tokens: list[int]) -> str:
            return self._tokenizer.decode(text_ids(tokens))

        return CacheMiss(at, miss.reason.value, decode(self.prompt[max(0, at - MISS_CONTEXT):at]),
                         decode(self.prompt[at:at + MISS_CONTEXT]), decode(miss.branch))

    def fail(self, error: Exception) -> None:
        if isinstance(error, ConstraintFailed):
            self.emit(ConstraintUnmet(f"the output constraint cannot be met: {error}"))
        else:
            self.emit(RequestFailed(f"the engine failed this request: {error}"))


class WaitingTokens:
    """A request's token events (with logprobs) that wait while their text is held back
    (it may start a stop string): a token's logprobs go out with its text, and never where
    all of its text is in the stop string that ended the reply, as the text is not
    returned (OpenAI's logprobs cover the tokens of the text returned)."""

    def __init__(self) -> None:
        self._waiting: list[tuple[int, TokenEvent]] = []  # (where its text starts, event)
        self._text = ""  # returned text that no event has carried yet

    def add(self, event: TokenEvent, start: int, shown: int, stopped: bool
            ) -> list[TokenEvent]:
        """The events to emit now that `event`'s token, whose text starts at character
        `start` of the decoded text, made the first `shown` characters returned; a token
        whose text starts at or after them waits, or once `stopped` goes without logprobs."""
        self._waiting.append((start, event))
        self._text += event.text
        count = sum(1 for begins, _ in self._waiting if begins < shown)
        ready = [waiting for _, waiting in self._waiting[:count]]
        if stopped:
            ready += [TokenEvent(waiting.token, "") for _, waiting in self._waiting[count:]]
            count = len(self._waiting)
        self._waiting = self._waiting[count:]
        return self._carrying(ready)

    def end(self, tail: str) -> tuple[list[TokenEvent], str]:
        """At the reply's end, with `tail` its last text: the waiting events, and the text
        no event carries."""
        self._text += tail
        ready = self._carrying([event for _, event in self._waiting])
        self._waiting = []
        text, self._text = self._text, ""
        return ready, text

    def _carrying(self, events: list[TokenEvent]) -> list[TokenEvent]:
        """`events`, the text returned so far on the first, none on the others."""
        if not events:
            return []
        text, self._text = self._text, ""
        return [replace(events[0], text=text), *(replace(e, text="") for e in events[1:])]
