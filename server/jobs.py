"""One request's engine work: submit prompts x n choices, merge their event streams,
account usage, and cancel it all (and let its model go) when the response ends.

A `Job` is always closed in a `finally` by its route, so an engine request never
outlives the HTTP request that asked for it (client gone, error, or drain deadline).
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING

from engine.api import (
    ConstraintUnmet,
    ContextLengthExceeded,
    EngineNotReady,
    Finish,
    Prompt,
    PromptLogprobs,
    QueueFull,
    RequestFailed,
    SamplingParams,
    TokenEvent,
    Unsupported,
)
from engine.streams import EventQueue
from server.events import Usage
from server.http.access_log import RequestStats
from server.http.drain import Drain, shutting_down
from server.http.errors import APIError, ServerBusy
from server.metrics import Metrics
from server.model_registry import RETRY_LATER

if TYPE_CHECKING:
    from engine.api import EngineClient
    from server.model_registry import Lease


class Job:
    def __init__(
        self, engine: EngineClient, drain: Drain, metrics: Metrics, request_id: str,
        started_at: float, report_miss: bool = False, lease: Lease | None = None,
    ) -> None:
        """`lease`: a hold on the engine's model, released when the job closes."""
        self.engine, self.drain, self.metrics, self.lease = engine, drain, metrics, lease
        self.report_miss = report_miss  # put the cache miss in usage (it is always logged)
        self.request_id = request_id
        self.started_at = started_at
        self.stats = RequestStats()
        self.n = 1
        self.constraint_param: str | None = None
        self._streams: list = []
        self._finishes: dict[int, Finish] = {}
        self._least_cached: dict[int, int] = {}  # per prompt: its choices' fewest cached
        self._tokens: Counter[int] = Counter()

    def submit(
        self, prompts: Sequence[Prompt], n: int, params: Callable[[int], SamplingParams],
        prompt_param: str | None = None, constraint_param: str | None = None,
    ) -> None:
        """Queue every choice: choice `p * n + j` is prompt p's j-th, with `params(j)`.

        All or nothing: if the engine refuses one, those already queued are cancelled.
        `prompt_param`: the request's field a prompt too long for the context is named
        by; `constraint_param`: the one whose grammar binds the reply, named where the
        model's output runs into a dead end of it."""
        self.n = n
        self.constraint_param = constraint_param
        # Known now, so a request whose client leaves before its Finish still logs it.
        self.stats.prompt_tokens = sum(len(prompt.tokens) for prompt in prompts)
        # Every choice of every prompt is one request to the engine's admission: it gets
        # its share of the batch, whatever n (`EngineClient.submit_all`).
        owner = uuid.uuid4().hex
        try:
            # Each choice's prompts together: a list of readouts is read in one forward.
            by_choice: list[list] = []
            for j in range(n):
                by_choice.append(self.engine.submit_all(prompts, params(j), owner=owner))
                self._streams.extend(by_choice[-1])  # what `close` cancels on a refusal
            self._streams = [by_choice[j][p] for p in range(len(prompts)) for j in range(n)]
        except ContextLengthExceeded as error:
            self.close()
            raise APIError(400, str(error), code="context_length_exceeded",
                           param=prompt_param) from error
        except QueueFull as error:
            self.close()
            raise ServerBusy(f"the server is busy: {error}", error.retry_after) from error
        except Unsupported as error:
            self.close()
            raise APIError(400, str(error), code="model_not_supported") from error
        except EngineNotReady as error:  # stopped: restarting, or unloaded meanwhile
            self.close()
            raise APIError(503, str(error), code="model_not_ready",
                           headers=RETRY_LATER) from error
        self.drain.jobs.add(self)

    @property
    def choices(self) -> int:
        return len(self._streams)

    def cancel(self) -> None:
        """Stop generating; `events` then ends with an error. Idempotent."""
        for stream in self._streams:
            stream.cancel()

    def abandon(self) -> None:
        """End every stream with the drain's error now, the engine's answer to `cancel`
        not awaited (its step may never end). Idempotent."""
        for stream in self._streams:
            stream.end_with(shutting_down())

    def close(self) -> None:
        """Cancel, stop reading and let the model go: the route's last word. Idempotent."""
        self.cancel()
        self.drain.jobs.discard(self)
        if self.lease is not None:
            self.lease.release()

    async def events(self) -> AsyncIterator[tuple[int, TokenEvent | PromptLogprobs | Finish]]:
        """Every choice's events, interleaved as they arrive."""
        last_token: dict[int, float] = {}
        async for index, event in self._arrivals():
            if isinstance(event, RequestFailed):
                raise APIError(
                    500, f"the engine failed this request (request id {self.request_id})",
                    code="engine_error",
                ) from event
            if isinstance(event, ConstraintUnmet):
                raise APIError(400, str(event), code="unsupported_schema",
                               param=self.constraint_param) from event
            if isinstance(event, Exception):
                raise event
            if isinstance(event, Finish) and event.reason == "cancelled":
                continue  # reported below, once every stream has ended
            if isinstance(event, TokenEvent):
                self._observe_token(index, last_token)
            elif isinstance(event, Finish):
                self._finish(index, event)
            yield index, event
        if len(self._finishes) < self.choices:
            # A stream ends without a Finish only when cancelled, and only the drain
            # cancels a job that is still being read.
            raise shutting_down()

    async def _arrivals(self) -> AsyncIterator[tuple[int, TokenEvent | PromptLogprobs | Finish | Exception]]:
        """(choice, event) as they arrive, or the exception a choice's stream raised. One
        stream is read as it is; several hand their events to one queue as they arrive
        (`RequestStream.forward_to`), each stream ending at its Finish or its error."""
        if len(self._streams) == 1:
            try:
                async for event in self._streams[0]:
                    yield 0, event
            except Exception as error:  # noqa: BLE001 - re-raised by the reader
                yield 0, error
            return
        arrived = EventQueue()
        for index, stream in enumerate(self._streams):
            stream.forward_to(lambda event, index=index: arrived.put((index, event)))
        open_streams = len(self._streams)
        while open_streams:
            index, event = await arrived.get()
            if isinstance(event, (Finish, BaseException)):
                open_streams -= 1
            yield index, event  # type: ignore[misc]

    def _observe_token(self, index: int, last_token: dict[int, float]) -> None:
        now = time.perf_counter()
        if self.stats.first_token_at is None:
            self.stats.first_token_at = now
            self.metrics.ttft.observe(now - self.started_at)
        if index in last_token:
            self.metrics.itl.observe(now - last_token[index])
        last_token[index] = now
        self.stats.last_token_at = now
        self._tokens[index] += 1
        self.stats.completion_tokens += 1

    def _finish(self, index: int, finish: Finish) -> None:
        self._finishes[index] = finish
        self._count_prompt(index // self.n, finish)
        miss = self._finishes[min(self._finishes)].cache_miss
        self.stats.cache_miss = miss and f"{miss.reason}@{miss.position}"
        # The engine's count replaces the tokens we saw for this choice.
        self.stats.completion_tokens += finish.completion_tokens - self._tokens[index]
        self.stats.draft_tokens += finish.draft_tokens
        self.stats.accepted_draft_tokens += finish.accepted_draft_tokens

    def _count_prompt(self, prompt: int, finish: Finish) -> None:
        """Keep the stats' prompt and cached tokens what `usage` gives, without going
        over every choice at each finish (a list of prompts has as many finishes)."""
        if not self._least_cached:  # the engine's counts replace those of `submit`
            self.stats.prompt_tokens = 0
        least = self._least_cached.get(prompt)
        if least is None:
            self.stats.prompt_tokens += finish.prompt_tokens
            self.stats.cached_tokens += finish.cached_tokens
            self._least_cached[prompt] = finish.cached_tokens
        elif finish.cached_tokens < least:
            self.stats.cached_tokens -= least - finish.cached_tokens
            self._least_cached[prompt] = finish.cached_tokens

    def usage(self) -> Usage:
        """Each prompt counts once, whatever n; its cached tokens are the least any of its
        choices found, i.e. what the cache held before this request computed anything."""
        prompt = cached = completion = 0
        for start in range(0, self.choices, self.n):
            finishes = [self._finishes.get(i) for i in range(start, start + self.n)]
            finishes = [finish for finish in finishes if finish is not None]
            if finishes:
                prompt += finishes[0].prompt_tokens
                cached += min(finish.cached_tokens for finish in finishes)
                completion += sum(finish.completion_tokens for finish in finishes)
        first = self._finishes.get(0)
        finished = self._finishes.values()
        return Usage(prompt, completion, cached,
                     cache_miss=first.cache_miss if first and self.report_miss else None,
                     prediction_tokens=sum(f.prediction_tokens for f in finished),
                     accepted_prediction_tokens=sum(f.accepted_prediction_tokens
                                                    for f in finished))

    def choice_usage(self, index: int) -> Usage:
        """Choice `index`'s own usage, once it has finished."""
        finish = self._finishes[index]
        return Usage(finish.prompt_tokens, finish.completion_tokens, finish.cached_tokens)
