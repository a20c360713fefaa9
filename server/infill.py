"""llama.cpp's /infill: fill in the middle for the editor plugins written for llama.cpp's
server (llama.vscode, llama.vim), in its own request and response shapes.

The body is llama.cpp's: the text before the cursor (`input_prefix`, with `prompt`, what
is typed at the cursor, after it), the text after it (`input_suffix`), other files of the
project (`input_extra`), and /completion's sampling fields, others ignored as llama.cpp
does. The answer is /completion's object, or with `stream`, its `data:` events: partial
ones with `content` as it comes, then the final one with `stop: true`, the counts and
`timings`. The prompt is built by the model's fill-in-the-middle tokens
(engine/fill_in_middle.py), as the OpenAI and Ollama APIs' `suffix` builds it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field

from engine.api import SamplingKnobs
from server.events import ChoiceFinished, TextDelta
from server.http.errors import APIError
from server.http.json_body import JSONRoute
from server.http.loading import respond_with_model
from server.http.model_response import model_response
from server.http.openapi import error_responses, event_stream
from server.http.streaming import CLIENT_CLOSED, GenerationEventSource, to_the_end
from server.model_registry import Lease
from server.openai.protocol import ErrorResponse
from server.pipeline import GenerationRun, start
from server.request import GenerationRequest, Infill, unset_knobs
from server.schema import RequestModel, ResponseModel
from server.state import server_state

router = APIRouter(responses=error_responses(ErrorResponse), route_class=JSONRoute)


class ExtraFile(RequestModel):
    filename: str = "tmp"  # llama.cpp's name for a chunk without one
    text: str = ""


class InfillRequest(RequestModel):
    model: str | None = None
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraFile] = Field(default_factory=list)
    prompt: str = ""  # typed at the cursor: it follows the prefix
    # llama.cpp's -1 (and /completion's default): until the model ends or the context does.
    n_predict: int = Field(-1, ge=-1)
    max_tokens: int | None = Field(None, ge=-1)  # its other name
    temperature: float | None = Field(None, ge=0)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None  # -1: a random one
    repeat_penalty: float | None = Field(None, gt=0)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stop: list[str] = Field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False

    @property
    def repetition_penalty(self) -> float | None:
        return self.repeat_penalty  # the name the model's sampling defaults know it by


class Timings(ResponseModel):
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


class InfillChunk(ResponseModel):
    """A streamed piece of the middle (llama.cpp's partial /completion result)."""

    index: int = 0
    content: str
    stop: bool = False
    tokens_evaluated: int


class InfillResponse(ResponseModel):
    """The whole middle, or a stream's last event (its `content` then empty)."""

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


@router.post("/infill", responses={
    200: {"model": InfillResponse, "content": event_stream(InfillChunk, ErrorResponse)}})
async def infill(body: InfillRequest, request: Request) -> Response:
    state = server_state(request)

    async def respond(lease: Lease) -> Response:
        ready = time.monotonic()
        run = await start(request, state, lease, generation_request(body))
        reply = InfillReply(state.models.name_for(lease.model, body.model or lease.model.id),
                            ready)
        if body.stream:
            return GenerationEventSource(run, _events(run, reply))
        results = await to_the_end(request, run, _whole(run, reply))
        if results is None:
            return Response(status_code=CLIENT_CLOSED)
        return model_response(results)

    return await respond_with_model(state.models, body.model, body.stream, respond,
                                    lambda error: [error.body().model_dump_json()])


def generation_request(body: InfillRequest) -> GenerationRequest:
    limit = body.n_predict if body.max_tokens is None else body.max_tokens
    return GenerationRequest(
        prompts=(body.input_prefix + body.prompt,),
        infill=Infill(body.input_suffix, tuple((f.filename, f.text) for f in body.input_extra),
                      param="input_suffix"),
        sampling=SamplingKnobs(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_k=body.top_k or 0,
            top_p=1.0 if body.top_p is None else body.top_p,
            min_p=body.min_p or 0.0,
            seed=None if body.seed in (None, -1) else body.seed,
            repetition_penalty=body.repeat_penalty,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            stop=tuple(body.stop),
            ignore_eos=body.ignore_eos,
        ),
        unset_sampling=unset_knobs(body),
        # A cap, as llama.cpp's n_predict: one past the context window is cut to fit it.
        max_tokens=limit if limit >= 0 else None,
        fit_context=True,
        stream=body.stream,
    )


class InfillReply:
    """One middle's events as llama.cpp's objects, with its timings: the prompt's from
    the model being ready to the first token, the middle's from there to the end."""

    def __init__(self, model: str, ready: float) -> None:
        self.model, self.ready = model, ready
        self.first: float | None = None

    def chunk(self, event: TextDelta, prompt_tokens: int) -> InfillChunk:
        """A streamed piece; it starts the middle's clock, for a whole answer too."""
        if self.first is None:
            self.first = time.monotonic()
        return InfillChunk(content=event.text, tokens_evaluated=prompt_tokens)

    def final(self, finished: ChoiceFinished, content: str) -> InfillResponse:
        now = time.monotonic()
        first = self.first or now
        usage = finished.usage
        matched = finished.matched_stop
        return InfillResponse(
            content=content, model=self.model, tokens_predicted=usage.completion_tokens,
            tokens_evaluated=usage.prompt_tokens, tokens_cached=usage.cached_tokens,
            stop_type=("limit" if finished.reason == "length"
                       else "word" if isinstance(matched, str) else "eos"),
            stopping_word=matched if isinstance(matched, str) else "",
            timings=_timings(usage.prompt_tokens, (first - self.ready) * 1000,
                             usage.completion_tokens, (now - first) * 1000))


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


async def _whole(run: GenerationRun, reply: InfillReply) -> InfillResponse:
    text = []
    async for event in run.events():
        if isinstance(event, TextDelta):
            reply.chunk(event, run.prompt_tokens)
            text.append(event.text)
        elif isinstance(event, ChoiceFinished):
            return reply.final(event, "".join(text))
    raise APIError(500, "the generation ended without finishing")


async def _events(run: GenerationRun, reply: InfillReply) -> AsyncIterator[str]:
    try:
        async for event in run.events():
            if isinstance(event, TextDelta) and (event.text or event.tokens):
                yield reply.chunk(event, run.prompt_tokens).model_dump_json()
            elif isinstance(event, ChoiceFinished):
                yield reply.final(event, "").model_dump_json()
    except APIError as error:
        # The status line went out already: the error is the stream's last event.
        yield error.body().model_dump_json()
