"""Running a `GenerationRequest`, once for every API front end.

`start` renders and tokenizes the prompt (the model's chat template, or raw prompts),
checks what the engine would refuse, and submits every choice. The returned `GenerationRun`
turns the engine's tokens into the neutral events of `server.events`: reasoning split
from the answer, tool calls parsed out of it, logprobs attached to the answer's tokens.
A front end renders those events (streamed, or folded by `events.collect`) and closes the
generation in a `finally`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields, replace
from typing import TypeVar

from fastapi import Request

from engine.api import (
    Constraint,
    Finish,
    Prompt,
    PromptLogprobs,
    SamplingKnobs,
    SamplingParams,
    TokenEvent,
)
from engine.tokenizer import ModelTokenizer, ThinkingMarkers, ToolCallFormat, TooManyTokens
from server import generic_tools
from server.config import SamplingDefaults, Settings
from server.events import (
    ChoiceFinished,
    ChoiceResult,
    Event,
    ReasoningDelta,
    TextDelta,
    Usage,
    fold,
)
from server.http.errors import APIError, PromptTooLong
from server.images import ImageLimits, load_images
from server.jobs import Job
from server.model_registry import Lease, ServedModel
from server.next_turn import NextTurn
from server.prompts import chat_prompt, check_token_ids, raw_prompts
from server.reasoning import ReasoningSplitter
from server.request import GenerationRequest
from server.state import ServerState
from server.structured import (
    constrained,
    constraint_param,
    forced_function,
    free_text,
    output_constraint,
    writes_calls,
)
from server.tools import ToolCallParser
from server.volatile import drop_volatile_lines

# A grammar's check waits for the one checker process (engine/grammar_check.py), up to
# 30 s for a schema of thousands of properties. On asyncio's default pool, a few such
# checks held every thread that prompts, /metrics and the stores need, stalling them all.
CONSTRAINT_CHECKS = ThreadPoolExecutor(2, thread_name_prefix="radix-mlx-constraint")


class ChoiceDecoder:
    """One choice's text into events: the echoed prompt first, if asked for, then the
    reply's reasoning split off, then tool calls."""

    def __init__(
        self,
        choice: int,
        reasoning: ReasoningSplitter | None,
        tools: ToolCallParser | None,
        logprobs: bool,
        echo: str | None = None,
    ) -> None:
        self.choice = choice
        self._reasoning, self._tools, self._logprobs = reasoning, tools, logprobs
        self._echo = echo  # the prompt's text, until it is sent
        # Tokens written inside the thinking block, markers included (None: no thinking).
        self.reasoning_tokens = None if reasoning is None else 0
        # Answer tokens whose text the tool parser holds back (maybe a call's marker):
        # their logprobs go out with that text, or not at all where it starts a call.
        self._held: list[TokenEvent] = []

    def prompt(self, event: PromptLogprobs) -> list[Event]:
        return self._echoed(event.tokens)

    def _echoed(self, tokens: tuple[TokenEvent, ...] = ()) -> list[Event]:
        """The echoed prompt, once, before anything else of the choice (with its tokens'
        logprobs, which come first when asked for)."""
        if self._echo is None:
            return []
        echo, self._echo = self._echo, None
        return [TextDelta(self.choice, echo, tokens if self._logprobs else ())]

    def token(self, event: TokenEvent) -> list[Event]:
        answering = self._answering()
        thinking = self._reasoning is not None and self._reasoning.inside
        events = self._echoed() + self._text(event.text, close=False)
        if self._reasoning is not None and (thinking or self._reasoning.inside):
            self.reasoning_tokens += 1
        if not self._logprobs:
            return events
        if answering and self._answering() and event.logprob is not None:
            # OpenAI's logprobs cover the answer's tokens, not thinking or tool calls.
            self._held.append(event)
        if self._attach_held(events):
            return events
        if not self._answering():
            self._held = []  # what was held back began a call
        elif self._held and (self._tools is None or not self._tools.holding):
            events.append(TextDelta(self.choice, "", tuple(self._held)))  # wrote nothing
            self._held = []
        return events

    def _attach_held(self, events: list[Event]) -> bool:
        """Put the held tokens' logprobs on the first text of `events`, if there is one."""
        at = next((i for i, e in enumerate(events) if isinstance(e, TextDelta)), None)
        if at is None:
            return False
        events[at] = TextDelta(self.choice, events[at].text, tuple(self._held))
        self._held = []
        return True

    def finish(self, finish: Finish, usage: Usage) -> list[Event]:
        events = self._echoed() + self._text(finish.text, close=True,
                                             cut=finish.reason == "length")
        if self._logprobs:  # held text that was no call's marker goes out with them
            self._attach_held(events)
        called = self._tools is not None and self._tools.calls > 0
        reason = "tool_calls" if called and finish.reason == "stop" else finish.reason
        assert reason != "cancelled"  # the job reports cancellation as an error
        usage = replace(usage, reasoning_tokens=self.reasoning_tokens)
        events.append(ChoiceFinished(self.choice, reason, usage, finish.matched_stop))
        return events

    def _answering(self) -> bool:
        in_reasoning = self._reasoning is not None and self._reasoning.inside
        return not in_reasoning and not (self._tools is not None and self._tools.in_call)

    def _text(self, text: str, close: bool, cut: bool = False) -> list[Event]:
        events: list[Event] = []
        answer = text
        if self._reasoning is not None:
            reasoning, answer = self._reasoning.feed(text)
            if close:
                rest_reasoning, rest_answer = self._reasoning.close()
                reasoning, answer = reasoning + rest_reasoning, answer + rest_answer
            if reasoning:
                events.append(ReasoningDelta(self.choice, reasoning))
        if self._tools is None:
            if answer:
                events.append(TextDelta(self.choice, answer))
            return events
        events += self._tools.feed(answer)
        if close:
            events += self._tools.close(cut)
        return events


class GenerationRun:
    """A submitted request: its engine job and one decoder per choice."""

    def __init__(
        self, request: GenerationRequest, job: Job, decoders: list[ChoiceDecoder],
        prompt_tokens: int, cached_tokens: int = 0, context_bound: bool = False,
        next_turn: NextTurn | None = None,
    ) -> None:
        self.request, self.job, self._decoders = request, job, decoders
        # A chat of one choice: its reply, folded as it goes, for the next turn's prefill.
        self._next_turn = next_turn
        self._reply = ChoiceResult()
        self._generated: list[int] = []
        # Known before the engine starts (Anthropic's message_start reports them). The
        # cached share is a peek (`usage_at_start`, else 0): an eviction or another
        # request's prefill before this one starts can change it, and the final usage
        # gives the count the engine found.
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens
        # The end of the context window, not a limit of the request or the server, is
        # where a reply that runs out of tokens stops.
        self.context_bound = context_bound

    @property
    def choices(self) -> int:
        return self.job.choices

    @property
    def request_id(self) -> str:
        return self.job.request_id

    async def events(self) -> AsyncIterator[Event]:
        """Every choice's events, interleaved as they arrive. Raises `APIError` if the
        engine fails the request or the server drains it away."""
        async for index, event in self.job.events():
            decoder = self._decoders[index]
            if isinstance(event, TokenEvent):
                events = decoder.token(event)
                self._generated.append(event.token)
            elif isinstance(event, PromptLogprobs):
                events = decoder.prompt(event)
            else:
                events = decoder.finish(event, self.job.choice_usage(index))
            for out in events:
                if self._next_turn is not None:
                    fold(self._reply, out)
                    if isinstance(out, ChoiceFinished):
                        self._next_turn.prefill(self._reply, self._generated)
                yield out

    def usage(self) -> Usage:
        """The whole request's usage so far (each prompt counted once, whatever n)."""
        counts = [decoder.reasoning_tokens for decoder in self._decoders]
        reasoning = None if None in counts else sum(counts)
        return replace(self.job.usage(), reasoning_tokens=reasoning)

    def usage_so_far(self) -> Usage:
        """A one-choice reply's usage before its end, for a front end that ends the reply
        itself (llama.cpp's limits on a completion's time and indentation)."""
        return Usage(self.prompt_tokens, len(self._generated), self.cached_tokens)

    def close(self) -> None:
        """Cancel whatever still runs. Idempotent; every front end calls it in a finally."""
        self.job.close()


async def render(model: ServedModel, request: GenerationRequest, generated: bool = False
                 ) -> list[Prompt]:
    """`request`'s prompts: a chat through the model's template, after its system messages
    lose the lines `volatile_system_lines` names (with its message ends when the engine
    snapshots there), or raw prompts. A prompt to be `generated` from, and not cut to fit
    (`keep_tokens`), is refused (`PromptTooLong`) without being encoded where its text
    alone shows it fills the context window."""
    tokenizer = model.tokenizer()
    images = []
    if request.images:
        if tokenizer.images is None:
            raise APIError(400, f"the model {model.id} does not read images",
                           code="invalid_image",
                           param="messages" if request.is_chat else "images")
        images = await load_images(request.images, image_limits(model.settings),
                                   tokenizer.images.settings)
    # Rendering and tokenizing a long conversation takes milliseconds: off the event
    # loop, so streams in flight keep flowing meanwhile.
    window = request.token_limit(model.engine.token_limit)
    # A reply needs a token of room; a prompt scored alone (echo, max_tokens 0) none.
    room = 0 if request.max_tokens == 0 else 1
    most_tokens = window - room if generated and request.keep_tokens is None else None
    try:
        if not request.is_chat:
            return await asyncio.to_thread(raw_prompts, tokenizer, request, window, images,
                                           most_tokens)
        request = _as_rendered(model, request)
        return [await asyncio.to_thread(chat_prompt, tokenizer, request,
                                        model.engine.wants_message_ends, images, most_tokens)]
    except TooManyTokens as error:
        # Anthropic's refusal gives a count, which Claude Code reads to compact the chat
        # by: the estimate's, close for any text, where the bound may be tenfold short.
        raise PromptTooLong(error.estimate, window, least=error.least,
                            param="messages" if request.is_chat else "prompt") from error


async def fits_context(lease: Lease, request: GenerationRequest) -> bool:
    """Does `request`'s prompt leave its model room for at least one token?"""
    try:
        prompts = await render(lease.model, request, generated=True)
    except PromptTooLong:
        return False
    return max(len(prompt.tokens) for prompt in prompts) < request.token_limit(
        lease.engine.token_limit)


T = TypeVar("T")


async def first_that_fits(lease: Lease, candidates: Sequence[T],
                          request: Callable[[T], GenerationRequest]) -> T | None:
    """The first of `candidates`, each shorter than the one before, whose `request` fits
    its model's context (`fits_context`), or None when not even the last does: found by
    bisection, as each try renders and tokenizes a whole prompt."""
    if not candidates or not await fits_context(lease, request(candidates[-1])):
        return None
    low, high = 0, len(candidates) - 1  # the first that fits is in here
    while low < high:
        middle = (low + high) // 2
        if await fits_context(lease, request(candidates[middle])):
            high = middle
        else:
            low = middle + 1
    return candidates[low]


def _as_rendered(model: ServedModel, request: GenerationRequest) -> GenerationRequest:
    """The chat as its template renders it: system lines the server drops gone, the
    model's template variables under the request's."""
    messages = drop_volatile_lines(request.messages, model.settings.volatile_system_lines)
    variables = {**model.spec.chat_template_kwargs, **request.chat_template_kwargs}
    return replace(request, messages=messages, chat_template_kwargs=variables)


def image_limits(settings: Settings) -> ImageLimits:
    return ImageLimits(settings.max_image_bytes, settings.max_image_pixels,
                       settings.max_images_per_request,
                       frozenset(host.lower() for host in settings.allow_image_urls))


async def start(http: Request, state: ServerState, lease: Lease, request: GenerationRequest,
                shorter: Callable[[], Awaitable[GenerationRequest]] | None = None,
                ) -> GenerationRun:
    """Render, tokenize, check and submit `request` to the model `lease` holds (the
    job releases it when the response ends); 4xx/5xx as `APIError`s. A prompt too long
    for the context window is a 400, or, where `shorter` is given, replaced by what it
    makes (a truncated conversation): only a prompt that does not fit is rendered twice."""
    try:
        try:
            return await _start(http, state, lease, request)
        except PromptTooLong:
            if shorter is None:
                raise
            return await _start(http, state, lease, await shorter())
    except BaseException:
        lease.release()
        raise


async def _start(http: Request, state: ServerState, lease: Lease, request: GenerationRequest
                 ) -> GenerationRun:
    model = lease.model
    settings = model.settings
    tokenizer = model.tokenizer()
    tool_format = _tool_format(tokenizer, request)
    prompts = await render(model, request, generated=True)
    if request.infill is not None:
        # A middle also ends where the model goes on to another file of the project, or pads.
        request = replace(request, sampling=replace(request.sampling, stop_token_ids=(
            *request.sampling.stop_token_ids, *tokenizer.fill_in_middle.ends)))
    window = request.token_limit(lease.engine.token_limit)
    if request.keep_tokens is not None:
        prompts = [cut_middle(prompt, request.keep_tokens, window)
                   for prompt in prompts]
    vocab_size = tokenizer.vocab_size
    sampling = request.sampling
    check_token_ids(sampling.logit_bias, vocab_size, "logit_bias")
    check_token_ids(sampling.stop_token_ids, vocab_size, "stop_token_ids")
    choices = len(prompts) * request.n
    if choices > settings.max_queue:
        # All are queued at once, so the engine would refuse this request every time.
        raise APIError(
            400, f"{choices} choices (prompts x n) exceed this server's queue of "
            f"{settings.max_queue}", code="invalid_request", param="n",
        )
    longest = max(len(prompt.tokens) for prompt in prompts)
    room = window - longest
    if request.fit_context and room < 1:
        # Its max_tokens is only a cap, so the engine's refusal would count 1 for it.
        raise PromptTooLong(longest, window, param="messages")
    max_tokens, context_bound = _max_tokens(request, settings, room)
    # Reasoning applies to chats only; raw prompts are continued as they are.
    markers = tokenizer.thinking if request.is_chat else None
    thinking = [_thinking(markers, prompt.tokens) for prompt in prompts]
    # Compiling a grammar takes milliseconds too: off the loop, once per distinct start
    # (free text has none, and the hop to a thread alone costs the loop ~0.1 ms).
    constraints = {
        after: await asyncio.get_running_loop().run_in_executor(
            CONSTRAINT_CHECKS, output_constraint, request, tool_format, after,
            settings.close_schema_objects)
        if constrained(request) else None
        for after in {after for _, after in thinking}
    }
    # No answer is longer than the context window: nor need its prediction be.
    prediction = tuple((await asyncio.to_thread(
        tokenizer.encode, request.prediction, special_tokens=False))[:window]
        if request.prediction else ())
    cached_tokens = 0
    if request.usage_at_start:
        # Before the job is submitted, after which its own prefill could read as cached;
        # off the loop: a round trip to an engine process.
        cached_tokens = sum([await asyncio.to_thread(lease.engine.cached_prefix, prompt.tokens)
                             for prompt in prompts])
    job = Job(lease.engine, state.drain, state.metrics, http.state.request_id,
              http.state.started_at, settings.cache_miss_details, lease)
    http.state.stats = job.stats
    defaults = model.spec.sampling
    job.submit(prompts, request.n, lambda choice: _choice_params(
        request, defaults, max_tokens, choice, constraints[thinking[choice // request.n][1]],
        prediction), prompt_param="messages" if request.is_chat else "prompt",
        constraint_param=constraint_param(request))
    echoes = [_echo(tokenizer, request, index, prompt) for index, prompt in enumerate(prompts)]
    decoders = [
        _decoder(request, markers, thinking[choice // request.n][0], tool_format, choice,
                 echoes[choice // request.n])
        for choice in range(choices)
    ]
    next_turn = None
    if settings.prefill_next_turn and request.is_chat and request.chat_end == "reply":
        model.follow_ups.note(request.messages)
        if request.n == 1 and model.follow_ups.worth_guessing():
            next_turn = NextTurn(state, model, _as_rendered(model, request), prompts[0])
    return GenerationRun(request, job, decoders, sum(len(prompt.tokens) for prompt in prompts),
                         cached_tokens, context_bound, next_turn)


def cut_middle(prompt: Prompt, keep: int, window: int) -> Prompt:
    """`prompt`, if it leaves no room in the `window`, as Ollama's runner cuts it: its
    first `keep` tokens (-1: all that fit) and its last ones, as many as leave half the
    rest of the window to the reply. Images are not cut through: such a prompt stays as it
    is (and too long)."""
    tokens = prompt.tokens
    if len(tokens) < window or prompt.images or window < 2:
        return prompt
    keep = window - 1 if keep < 0 else min(keep, window - 1)
    tail = window - max((window - keep) // 2, 1) - keep
    # Its message ends no longer mark the messages' ends, and a cut prompt is not sent
    # again as it is: none.
    return Prompt(tokens[:keep] + tokens[len(tokens) - tail:])


def _max_tokens(request: GenerationRequest, settings: Settings, room: int) -> tuple[int, bool]:
    """(the most tokens each choice generates, whether `room`, what the context window
    leaves after the longest prompt, is what set it). A request's own limit is kept as it
    is, or as a cap (`fit_context`): lowered to the server's `max_output_tokens` and to the
    room. Without one, a chat gets `default_max_tokens` where it is set; otherwise every
    API's reply may run to the room, short of `max_output_tokens`."""
    if not request.fit_context:
        if request.max_tokens is not None:  # 0 too: an echo that only scores the prompt
            return request.max_tokens, False
        if settings.default_max_tokens is not None:
            return max(1, min(settings.default_max_tokens, room)), False
    # 0 too: llama.cpp's n_predict 0 computes (and caches) the prompt and writes nothing.
    limits = [limit for limit in (request.max_tokens, settings.max_output_tokens)
              if limit is not None]
    if limits and min(limits) <= room:
        return min(limits), False
    return max(1, room), True


def _echo(tokenizer: ModelTokenizer, request: GenerationRequest, index: int, prompt: Prompt
          ) -> str | None:
    """The text an echo sends back for prompt `index`: as given, or its token ids decoded."""
    if not request.echo:
        return None
    given = request.prompts[index]
    return given if isinstance(given, str) else tokenizer.decode(prompt.tokens)


def _decoder(
    request: GenerationRequest,
    markers: ThinkingMarkers | None,
    inside: bool,
    tool_format: ToolCallFormat,
    choice: int,
    echo: str | None,
) -> ChoiceDecoder:
    reasoning = tools = None
    if markers is not None:
        reasoning = ReasoningSplitter(markers.start, markers.end, inside)
    if request.offered_tools:
        tools = ToolCallParser(
            choice, tool_format, [tool.template_form() for tool in request.offered_tools],
            parallel=request.parallel_tool_calls is not False, forced=forced_function(request),
            id_prefix=request.call_id_prefix,
        )
    return ChoiceDecoder(choice, reasoning, tools, request.logprobs is not None, echo)


def _tool_format(tokenizer: ModelTokenizer, request: GenerationRequest) -> ToolCallFormat:
    """How this request's tool calls are written: the model's own format, or the generic
    one when mlx-lm knows none for its family. A call the grammar writes is JSON between the
    format's markers, so it is read as JSON whatever the family."""
    model_format = tokenizer.tool_calls
    if model_format is None:
        return generic_tools.FORMAT
    if writes_calls(request):
        return replace(model_format, parse=generic_tools.FORMAT.parse)
    return model_format


# A template that closes the thinking block for the model (thinking off) puts the end
# marker right at the end of the generation prompt, at most this many tokens before it.
CLOSED_THINKING_TAIL = 4


def _thinking(markers: ThinkingMarkers | None, prompt: list[int]) -> tuple[bool, str | None]:
    """(does the prompt leave the model inside a thinking block, the marker a grammar
    must wait for: None when the template closed the block for the model). A model whose
    vocabulary has the markers but which answers without thinking would leave a grammar
    waiting, so its answer would be unconstrained: mlx-lm's markers are a reasoning
    family's, which think first (Qwen3 with thinking on, the R1 distills)."""
    if markers is None:
        return False, None
    last_end = _rfind(prompt, markers.end_tokens)
    inside = _rfind(prompt, markers.start_tokens) > last_end
    closed = not inside and last_end >= len(prompt) - CLOSED_THINKING_TAIL
    return inside, None if closed else markers.end


def _rfind(tokens: list[int], marker: tuple[int, ...]) -> int:
    """Where `marker` last occurs in `tokens`, or -1. Candidates are found with list.index
    on the reversed prompt (C speed), since agents send prompts of 50k tokens."""
    backwards = tokens[::-1]
    start = 0
    while True:
        try:
            found = backwards.index(marker[0], start)
        except ValueError:
            return -1
        at = len(tokens) - 1 - found
        if tuple(tokens[at:at + len(marker)]) == marker:
            return at
        start = found + 1


def _choice_params(
    request: GenerationRequest, defaults: SamplingDefaults, max_tokens: int, choice: int,
    constraint: Constraint | None, prediction: tuple[int, ...] = (),
) -> SamplingParams:
    """The engine's parameters for choice `choice` (which offsets the seed, so the n
    choices of a seeded request differ from each other yet stay reproducible): the one
    place a request's `SamplingParams` are made. A knob the request leaves unset takes the
    model's default, where its table sets one."""
    knobs = request.sampling
    given = {knob.name: getattr(knobs, knob.name) for knob in fields(SamplingKnobs)}
    given.update({name: value for name, value in defaults if value is not None
                  and name in request.unset_sampling})
    if knobs.seed is not None:
        given["seed"] = knobs.seed + choice
    if constraint is not None and not free_text(request):
        # Stop sequences and stop token ids end free text; a grammar ends its reply itself.
        given["stop"] = given["stop_token_ids"] = ()
    return SamplingParams(
        **given,
        max_tokens=max_tokens,
        logprobs=request.logprobs,
        prompt_logprobs=request.logprobs if request.echo else None,
        constraint=constraint,
        prediction=prediction,
    )
