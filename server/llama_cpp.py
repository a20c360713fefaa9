"""llama.cpp's native completion endpoints, /completion and /infill, and its /props, in
its own request and response shapes: for clients written for llama.cpp's server (SillyTavern's and
editors' llama.cpp providers, llama.vscode and llama.vim's autocomplete).

A body is /completion's: `prompt` (text, or token ids) and its sampling fields, `n_probs`
(each token's likeliest alternatives), llama.cpp's `json_schema` and GBNF `grammar`;
fields of llama.cpp's own machinery (slots, samplers' order, time limits) are ignored, as
llama.cpp ignores fields it does not know. /infill fills in the middle: the text before
the cursor (`input_prefix`, with `prompt`, what is typed at the cursor, after it), the
text after it (`input_suffix`) and other files of the project (`input_extra`), prompted
with the model's fill-in-the-middle tokens (engine/fill_in_middle.py) as the OpenAI and
Ollama APIs' `suffix` is, and cut as llama.cpp cuts it to leave the reply its room (the
code at the gap first, then the files' latest tokens). The answer is /completion's object, or with `stream`, its
`data:` events: partial ones with `content` as it comes, then the final one with `stop:
true`, the counts and `timings`. Either ends early where llama.cpp's editor plugins ask
it to (`n_indent`, `t_max_predict_ms`: `_within_limits`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field

from engine.api import SamplingKnobs, TokenEvent, TokenLogprob
from server.clock import Clock
from server.events import ChoiceFinished, ChoiceResult, Event, TextDelta, collect, fold
from server.http.errors import APIError
from server.http.json_body import AnyTypeJSONRoute
from server.http.loading import respond_with_model
from server.http.model_response import model_response
from server.http.openapi import error_responses, event_stream
from server.http.streaming import CLIENT_CLOSED, GenerationEventSource, to_the_end
from server.model_registry import Lease
from server.openai.protocol import ErrorResponse, GrammarText, SchemaDocument, TokenId
from server.pipeline import GenerationRun, start
from server.request import (
    TEXT,
    GenerationRequest,
    GrammarOutput,
    Infill,
    JsonSchemaOutput,
    OutputFormat,
    unset_knobs,
)
from server.schema import MAX_TOP_LOGPROBS, RequestModel, ResponseModel, StopStrings
from server.state import server_state

router = APIRouter(responses=error_responses(ErrorResponse), route_class=AnyTypeJSONRoute)


class ExtraFile(RequestModel):
    filename: str = "tmp"  # llama.cpp's name for a chunk without one
    text: str = ""


class LlamaRequest(RequestModel):
    """/completion's fields besides the prompt, which /infill takes too."""

    model: str | None = None
    # llama.cpp's -1 (/completion's default) and -2: until the model ends, or the context.
    n_predict: int = Field(-1, ge=-2)
    max_tokens: int | None = Field(None, ge=-2)  # its other name
    temperature: float | None = Field(None, le=2)  # at or below 0: greedy, as llama.cpp's
    top_k: int | None = None  # at or below 0: off, as llama.cpp's
    top_p: float | None = Field(None, gt=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-1, lt=2**63)  # -1: a random one
    # As Chat Completions' repetition_penalty: seen tokens' logits are divided by it, and
    # a float32 zero made them infinite and the logprobs NaN.
    repeat_penalty: float | None = Field(None, ge=0.01, le=10)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stop: str | StopStrings = Field(default_factory=list)
    ignore_eos: bool = False
    n_probs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    json_schema: SchemaDocument | None = None
    grammar: GrammarText = None
    stream: bool = False
    # Editors' autocomplete (llama.vscode, llama.vim): the reply ends at a line indented
    # less than this, or at a newline once this many ms passed since its first token.
    n_indent: int = 0
    t_max_predict_ms: int = 0

    @property
    def repetition_penalty(self) -> float | None:
        return self.repeat_penalty  # the name the model's sampling defaults know it by


class CompletionRequest(LlamaRequest):
    prompt: str | list[TokenId] = Field(min_length=1)


class InfillRequest(LlamaRequest):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraFile] = Field(default_factory=list)
    prompt: str = ""  # typed at the cursor: it follows the prefix


class Alternative(ResponseModel):
    id: int
    token: str
    bytes: list[int]
    logprob: float


class TokenProbabilities(Alternative):
    """A generated token's entry of `completion_probabilities` (`n_probs`)."""

    top_logprobs: list[Alternative]


class Timings(ResponseModel):
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


class CompletionChunk(ResponseModel):
    """A streamed piece of the text (llama.cpp's partial result)."""

    index: int = 0
    content: str
    stop: bool = False
    tokens_evaluated: int
    completion_probabilities: list[TokenProbabilities] | None = None


class CompletionResponse(ResponseModel):
    """The whole text, or a stream's last event (its `content` then empty)."""

    index: int = 0
    content: str
    stop: bool = True
    model: str
    tokens_predicted: int
    tokens_evaluated: int
    tokens_cached: int
    truncated: bool = False
    stop_type: str  # eos, word (a stop string) or limit
    stopping_word: str
    timings: Timings
    completion_probabilities: list[TokenProbabilities] | None = None


class GenerationSettings(ResponseModel):
    n_ctx: int


class Modalities(ResponseModel):
    vision: bool
    audio: bool = False


class Props(ResponseModel):
    """What llama.cpp's GET /props says of its model, as its clients read it: the context
    window (`default_generation_settings.n_ctx`), how many requests decode at once, the
    chat template, whether it reads images."""

    default_generation_settings: GenerationSettings
    total_slots: int
    model_path: str
    chat_template: str
    modalities: Modalities
    build_info: str = "radix-mlx"


@router.get("/props")
async def props(request: Request, model: str | None = None) -> Props:
    """The model's (`?model=`, else the server's first), loaded to answer."""
    state = server_state(request)
    async with state.models.use(model) as lease:
        served = lease.model
        tokenizer = served.tokenizer()
        return Props(
            default_generation_settings=GenerationSettings(n_ctx=lease.engine.token_limit),
            total_slots=served.settings.max_batch_size, model_path=served.id,
            chat_template=tokenizer.chat_template_text,
            modalities=Modalities(vision=tokenizer.images is not None))


RESPONSES: dict[int | str, dict[str, Any]] = {200: {
    "model": CompletionResponse,
    "content": event_stream(CompletionChunk | CompletionResponse, ErrorResponse)}}


@router.post("/completion", responses=RESPONSES)
@router.post("/completions", responses=RESPONSES, include_in_schema=False)
async def completion(body: CompletionRequest, request: Request) -> Response:
    prompt = body.prompt if isinstance(body.prompt, str) else tuple(body.prompt)
    return await _answer(request, body, _generation(body, prompts=(prompt,)))


@router.post("/infill", responses=RESPONSES)
async def infill(body: InfillRequest, request: Request) -> Response:
    extra = tuple((chunk.filename, chunk.text) for chunk in body.input_extra)
    return await _answer(request, body, _generation(
        body, prompts=(body.input_prefix + body.prompt,),
        infill=Infill(body.input_suffix, extra, param="input_suffix", fit=True)))


async def _answer(request: Request, body: LlamaRequest, generation: GenerationRequest
                  ) -> Response:
    state, clock = server_state(request), Clock()

    async def respond(lease: Lease) -> Response:
        clock.ready()
        run = await start(request, state, lease, generation)
        reply = LlamaReply(state.models.name_for(lease.model, body.model or lease.model.id),
                           clock)
        if body.stream:
            return GenerationEventSource(run, _events(run, reply, body))
        results = await to_the_end(request, run, _whole(run, reply, body))
        if results is None:
            return Response(status_code=CLIENT_CLOSED)
        return model_response(results, exclude_none=True)

    return await respond_with_model(state.models, body.model, body.stream, respond,
                                    lambda error: [error.body().model_dump_json()])


def _generation(body: LlamaRequest, **prompt: Any) -> GenerationRequest:
    limit = body.n_predict if body.max_tokens is None else body.max_tokens
    return GenerationRequest(
        **prompt,
        output=_output_format(body),
        sampling=SamplingKnobs(
            temperature=1.0 if body.temperature is None else max(body.temperature, 0.0),
            top_k=max(body.top_k or 0, 0),
            top_p=1.0 if body.top_p is None else body.top_p,
            min_p=body.min_p or 0.0,
            seed=None if body.seed in (None, -1) else body.seed,
            repetition_penalty=body.repeat_penalty,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop),
            ignore_eos=body.ignore_eos,
        ),
        unset_sampling=unset_knobs(body),
        # A cap, as llama.cpp's n_predict: one past the context window is cut to fit it.
        max_tokens=limit if limit >= 0 else None,
        fit_context=True,
        logprobs=body.n_probs or None,
        stream=body.stream,
    )


def _output_format(body: LlamaRequest) -> OutputFormat:
    if body.json_schema is not None and body.grammar is not None:
        raise APIError(400, "send json_schema or grammar, not both", param="grammar")
    if body.json_schema is not None:
        return JsonSchemaOutput("json_schema", body.json_schema, param="json_schema")
    if body.grammar is not None:
        return GrammarOutput("grammar", body.grammar, "grammar")
    return TEXT


class LlamaReply:
    """One answer's events as llama.cpp's objects, with its timings: the prompt's from
    the model being ready to the first token, the text's from there to the end."""

    def __init__(self, model: str, clock: Clock) -> None:
        self.model, self.clock = model, clock

    def chunk(self, event: TextDelta, prompt_tokens: int) -> CompletionChunk:
        self.clock.token()
        return CompletionChunk(content=event.text, tokens_evaluated=prompt_tokens,
                               completion_probabilities=_probabilities(event.tokens))

    def final(self, result: ChoiceResult, whole: bool) -> CompletionResponse:
        """The last object: `result`'s counts and stop, and where it is the `whole` answer
        (not a stream's last event) its text and probabilities."""
        usage, matched = result.usage, result.matched_stop
        durations = self.clock.durations()
        return CompletionResponse(
            content=result.text if whole else "", model=self.model,
            tokens_predicted=usage.completion_tokens,
            tokens_evaluated=usage.prompt_tokens, tokens_cached=usage.cached_tokens,
            stop_type=("limit" if result.finish_reason == "length"
                       else "word" if isinstance(matched, str) else "eos"),
            stopping_word=matched if isinstance(matched, str) else "",
            timings=_timings(usage.prompt_tokens, durations.prompt / 1e6,
                             usage.completion_tokens, durations.generation / 1e6),
            completion_probabilities=_probabilities(result.tokens) if whole else None)


def _timings(prompt_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float
             ) -> Timings:
    def per(count: int, ms: float) -> tuple[float, float]:
        return (ms / count if count else 0.0), (count * 1000 / ms if ms > 0 else 0.0)

    prompt_per_token, prompt_per_second = per(prompt_n, prompt_ms)
    predicted_per_token, predicted_per_second = per(predicted_n, predicted_ms)
    return Timings(prompt_n=prompt_n, prompt_ms=prompt_ms,
                   prompt_per_token_ms=prompt_per_token, prompt_per_second=prompt_per_second,
                   predicted_n=predicted_n, predicted_ms=predicted_ms,
                   predicted_per_token_ms=predicted_per_token,
                   predicted_per_second=predicted_per_second)


def _probabilities(tokens: list[TokenEvent] | tuple[TokenEvent, ...]
                   ) -> list[TokenProbabilities] | None:
    """llama.cpp's `completion_probabilities` of tokens drawn with logprobs; None without."""
    if not tokens or tokens[0].logprob is None:
        return None
    return [TokenProbabilities(**_alternative(event.logprob).model_dump(),
                               top_logprobs=[_alternative(top) for top in event.top_logprobs])
            for event in tokens if event.logprob is not None]


def _alternative(logprob: TokenLogprob) -> Alternative:
    return Alternative(id=logprob.token, token=logprob.text, bytes=list(logprob.bytes),
                       logprob=logprob.logprob)


async def _whole(run: GenerationRun, reply: LlamaReply, body: LlamaRequest
                 ) -> CompletionResponse:
    [result] = await collect(_clocked(_within_limits(run, body), reply.clock), 1)
    return reply.final(result, whole=True)


def _within_limits(run: GenerationRun, body: LlamaRequest) -> AsyncIterator[Event]:
    """`run`'s events, ended as llama.cpp ends a completion for an editor (`_limited`)
    where the request sets a limit."""
    if body.n_indent <= 0 and body.t_max_predict_ms <= 0:
        return run.events()
    return _limited(run, body)


async def _limited(run: GenerationRun, body: LlamaRequest) -> AsyncIterator[Event]:
    """`run`'s events until a finish of reason "length" (its stop type "limit"; the
    caller then closes the generation): at a line indented less than `n_indent`
    (`IndentLimit`), or at text with a newline once `t_max_predict_ms` passed since the
    first token (that text kept)."""
    events = run.events()
    indent, first_token = IndentLimit(body.n_indent), None
    async for event in events:
        if not (isinstance(event, TextDelta) and event.text):
            yield event
            continue
        first_token = first_token or time.monotonic()
        if (kept := indent.feed(event.text)) is not None:
            yield replace(event, text=event.text[:kept])
            break
        yield event
        if (body.t_max_predict_ms > 0 and "\n" in event.text
                and (time.monotonic() - first_token) * 1e3 > body.t_max_predict_ms):
            break
    else:
        return
    await events.aclose()
    yield ChoiceFinished(event.choice, "length", run.usage_so_far())


class IndentLimit:
    """llama.cpp's `n_indent`: a completion ends at the first character, a newline
    included, of a line after its first that is indented by fewer than `n_indent` spaces
    or tabs (the text cut before that character). Off at 0."""

    def __init__(self, n_indent: int) -> None:
        self.n_indent = n_indent
        self._text = ""  # the completion so far
        self._line: int | None = None  # where a line not judged yet starts
        self._searched = 0  # where the search for the next line goes on from

    def feed(self, piece: str) -> int | None:
        """How many characters of `piece`, the completion's next text, it keeps where it
        ends in them; None: all, and it goes on."""
        if self.n_indent <= 0:
            return None
        start = len(self._text)
        self._text += piece
        cut = self._cut()
        return None if cut is None else cut - start

    def _cut(self) -> int | None:
        text = self._text
        while True:
            if self._line is None:
                newline = text.find("\n", self._searched)
                if newline < 0:
                    self._searched = len(text)
                    return None
                self._line = newline + 1
            first = self._line
            while first < len(text) and text[first] in " \t":
                first += 1
            if first == len(text):
                return None  # only indentation so far
            if first - self._line < self.n_indent:
                return first
            self._line, self._searched = None, first


async def _clocked(events: AsyncIterator[Event], clock: Clock) -> AsyncIterator[Event]:
    """`events`, the first token's time noted on `clock`."""
    async for event in events:
        if isinstance(event, TextDelta):
            clock.token()
        yield event


async def _events(run: GenerationRun, reply: LlamaReply, body: LlamaRequest
                  ) -> AsyncIterator[str]:
    finished = ChoiceResult()
    try:
        async for event in _within_limits(run, body):
            if isinstance(event, TextDelta) and (event.text or event.tokens):
                yield reply.chunk(event, run.prompt_tokens).model_dump_json(exclude_none=True)
            elif isinstance(event, ChoiceFinished):
                fold(finished, event)
                yield reply.final(finished, whole=False).model_dump_json(exclude_none=True)
    except APIError as error:
        # The status line went out already: the error is the stream's last event.
        yield error.body().model_dump_json()
