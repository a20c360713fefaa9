"""The engine's public API, importable without MLX: what crosses the boundary between the
engine and its callers.

The server builds an `EngineConfig`, watches the engine's `Lifecycle`, builds a `Prompt`
and a `SamplingParams` per request, calls `Engine.submit` and reads `TokenEvent`s followed
by one `Finish` from the returned `RequestStream`; `Engine.cancel` ends a request early, and
`Engine.stats` gives an `EngineStats` for /metrics. The engine itself (engine.py) imports
MLX; nothing here does, so the server's own modules import only this one,
engine/tokenizer.py and engine/constraints.py (the grammars of `SamplingParams.constraint`).
"""

from __future__ import annotations

import asyncio
import enum
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal, Protocol

from radix.stats import stat
from radix.tree import TreeStats

FinishReason = Literal["stop", "length", "cancelled"]


class Lifecycle(str, enum.Enum):
    LOADING = "loading"
    WARMING_UP = "warming_up"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True)
class EngineConfig:
    model: str
    cache_bytes: int | None = None
    cache_fraction: float = 0.5
    max_batch_size: int = 32
    # Admitted in the cache-aware order (admission.py) and computed in turn: a small
    # window keeps a request that arrives behind a long cold prompt, but whose prompt is
    # mostly cached, from waiting for that prompt. At 64 on an H100 (Llama-1B shape,
    # shared-prefix, 16 at once, stall ratio 0.1) followers whose prefix was cached after
    # 0.5 s waited 6 s behind the last group's cold 2000-token prompt: 10.9 s in all
    # against 5.8 s at 8 (TTFT p99 8.6 vs 4.6 s). Short prompts do not count against it
    # (admission.py): they are computed together in one forward.
    prefill_batch_size: int = 8
    prefill_chunk_tokens: int | None = None  # None: the device's default
    # While requests decode, prefill may add this share of a decode step to each step,
    # on average, and at least the floor (engine/prefill_budget.py). None: the device's
    # default (scheduler.py).
    prefill_stall_ratio: float | None = None
    prefill_stall_floor_seconds: float = 0.02
    max_tokens_in_flight: int = 131072
    max_queue: int = 256
    memory_limit_bytes: int | None = None  # None: the device's (engine/memory.py)
    # Without a memory limit: the share of the device's memory this process plans for
    # (N servers side by side on one device: 1/N each).
    memory_share: float = 1.0
    # The disk tier: off unless a directory and a budget are given (None: a share of the
    # free space there, see disk_store.default_disk_budget; 0: off).
    disk_cache_dir: str | None = None
    disk_cache_bytes: int | None = 0
    # Tensor parallelism: how long one scheduler step may take before the group counts
    # as lost (a rank that hangs must not hang the server).
    collective_timeout: float = 60.0
    # Jinja source rendering chats instead of the model's own template (None: its own).
    chat_template: str | None = None


@dataclass
class SchedulerCounters:
    """What the scheduler counts as it works; described for /metrics in one place."""

    prompt_tokens: int = stat("counter", "Prompt tokens of finished prefills.")
    cached_tokens: int = stat("counter", "Prompt tokens served from the radix cache.")
    prefill_tokens: int = stat("counter", "Prompt tokens computed by prefill.")
    generated_tokens: int = stat("counter", "Tokens generated.")
    requests_failed: int = stat("counter", "Requests the engine failed.",
                                name="engine_requests_failed")
    constrained_requests: int = stat("counter", "Requests decoded under a grammar "
                                     "(structured output, forced tool calls).",
                                     name="engine_constrained_requests")
    steps: int = stat("counter", "Engine scheduler steps.", name="engine_steps")
    step_seconds: float = stat("counter", "Seconds spent in engine steps.", default=0.0,
                               name="engine_step_seconds")
    # Near step_seconds, the engine is host-bound: its thread's Python (building graphs,
    # sampling, detokenizing) is the step, and anything else that takes the GIL slows it.
    step_cpu_seconds: float = stat("counter", "CPU seconds the engine's thread spent in "
                                   "engine steps.", default=0.0,
                                   name="engine_step_cpu_seconds")


@dataclass
class DiskStats:
    """What the disk tier's store counts (the tree counts the tier's bytes and hits)."""

    writes: int = stat("counter", "Copies written to the disk tier.", name="disk_writes")
    write_bytes: int = stat("counter", "Bytes written to the disk tier.",
                            name="disk_write_bytes")
    writes_dropped: int = stat("counter", "Copies not made: the disk writer's queue was full.",
                               name="disk_writes_dropped")
    write_errors: int = stat("counter", "Copies whose write failed.", name="disk_write_errors")
    queued_bytes: int = stat("gauge", "Bytes waiting in the disk writer's queue.",
                             name="disk_queued_bytes")
    loads: int = stat("counter", "Copies loaded back into memory.", name="disk_loads")
    load_bytes: int = stat("counter", "Bytes read back from disk files.",
                           name="disk_load_bytes")
    load_seconds: float = stat("counter", "Seconds spent reading disk files back.",
                               default=0.0, name="disk_load_seconds")
    bad_files: int = stat("counter", "Disk files skipped and deleted (torn, truncated, "
                          "foreign or corrupt).", name="disk_bad_files")
    restored_nodes: int = stat("counter", "Tree nodes rebuilt from disk files at start.",
                               name="disk_restored_nodes")
    rebuilding: int = stat("gauge", "1 while the tree is being rebuilt from disk.",
                           name="disk_rebuilding")


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for /metrics: the queue, the scheduler's counters and the tree's own
    stats, composed rather than copied, so a new counter is added in one place (its
    dataclass, with its `stat` description) and reaches /metrics by itself."""

    waiting: int = stat("gauge", "Requests submitted and not yet started.",
                        name="queue_depth")
    running: int = stat("gauge", "Requests in the running batch.", name="running_requests")
    active_memory_bytes: int = stat("gauge", "MLX active memory.")
    memory_limit_bytes: int = stat(
        "gauge", "Memory planned for weights, prefix cache, activations and running KV.")
    weight_bytes: int = stat(
        "gauge", "Bytes of the model's weights in this process (its shard under tensor "
        "parallelism).")
    kv_token_capacity: int = stat(
        "gauge", "Prompt + max_tokens of running requests that the memory plan holds.")
    tokens_in_flight: int = stat("gauge", "Prompt + max_tokens of the running requests.")
    counters: SchedulerCounters = field(default_factory=SchedulerCounters)
    tree: TreeStats = field(default_factory=TreeStats)
    disk: DiskStats = field(default_factory=DiskStats)


@dataclass(frozen=True)
class Prompt:
    """A prompt's token ids, and where the messages of the chat it renders end in them.

    `message_ends`: token counts at which a message is complete (the system prompt, each
    turn), ascending. Models whose cache is reused only as whole-state snapshots
    (sliding-window or recurrent layers; see `Engine.wants_message_ends`) snapshot it
    there during prefill, so a later prompt sharing those messages (another conversation
    with the same system prompt, the next turn, the same few-shot turns) reuses them.
    Models with plain KV caches reuse any prefix and need none. Raw completions have none.
    """

    tokens: list[int]
    message_ends: tuple[int, ...] = ()


@dataclass(frozen=True)
class Constraint:
    """A grammar the generated text must follow (structured output, forced tool calls).

    Build one with `engine.constraints` (json_object, json_schema, tool_calls) rather
    than by hand. The engine masks every token the grammar does not allow, from the
    first generated token on, allows EOS only where the grammar accepts, and ends the
    request with finish reason "stop" once the grammar is complete. Logprobs, when asked
    for, stay the model's own (before the mask), as OpenAI reports them. A grammar that
    does not compile fails the request (RequestFailed) at its start.
    """

    # llguidance's serialized grammar (what `LLMatcher.grammar_from_*` return); equal
    # grammars share one compiled copy in the engine.
    grammar: str
    # Text the model writes freely before the grammar applies: the grammar starts right
    # after the first time the generated tokens contain this marker's tokens (e.g. the
    # end-of-thinking "</think>" of a reasoning model). None: from the first token. Leave
    # it None when the prompt already closed the reasoning (a template that renders
    # "<think></think>" when thinking is off), or the grammar would never start.
    after: str | None = None


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
    constraint: Constraint | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    text: str
    logprob: float
    bytes: bytes  # the token's own bytes: part of a character where it holds only part


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


def check_request(tokens: list[int], params: SamplingParams, context_length: int,
                  kv_tokens: int) -> None:
    """Raise if a prompt cannot be generated from at all: empty, or prompt + max_tokens past
    the model's context window or the KV that the server's memory plan holds."""
    if not tokens:
        raise ValueError("the prompt is empty")
    requested = len(tokens) + params.max_tokens
    if requested > context_length:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {context_length} tokens. "
            f"However, you requested {requested} tokens "
            f"({len(tokens)} in the prompt, {params.max_tokens} for the completion).")
    if requested > kv_tokens:
        raise ContextLengthExceeded(
            f"This server's memory holds the KV of {kv_tokens} tokens at "
            f"most (memory_limit_bytes). However, you requested {requested} tokens "
            f"({len(tokens)} in the prompt, {params.max_tokens} for the completion).")


class WaitingCount:
    """Requests submitted and not yet started, at most `limit` (`max_queue`)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.value = 0
        self._lock = threading.Lock()

    def enter(self) -> None:
        """Count one more, or raise QueueFull."""
        with self._lock:
            if self.value >= self.limit:
                raise QueueFull(f"{self.value} requests are already waiting", retry_after=1.0)
            self.value += 1

    def leave(self) -> None:
        with self._lock:
            self.value -= 1


class Relay(Protocol):
    """Where a `RequestStream`'s events go from the engine's thread."""

    def put(self, stream: RequestStream, event: object) -> None: ...


class LoopRelay:
    """Carries events from the engine's thread to one asyncio loop, many per wake-up.

    Waking a loop from another thread costs a write to its self-pipe, a turn of the loop
    and a round of the GIL between the threads; a decode step of 64 streams would pay it
    64 times. Events wait here instead, and one wake-up delivers all that wait then. While
    the engine's thread `gathers` (it serves its steps), its events wait for `wake` at the
    end of the step: a loop that woke on the step's first event would otherwise take the
    GIL mid-step and need another wake-up for the rest (about ten per 64-row step)."""

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 gathers: Callable[[], bool] = lambda: False) -> None:
        self.loop = loop
        self._gathers = gathers
        self._lock = threading.Lock()
        self._pending: list[tuple[RequestStream, object]] = []
        self._scheduled = False

    def put(self, stream: RequestStream, event: object) -> None:
        """Called from the engine's thread."""
        if self.loop.is_closed():  # nobody reads this stream any more
            stream.cancel()
            return
        with self._lock:
            self._pending.append((stream, event))
            if self._scheduled or self._gathers():
                return  # a delivery is scheduled already, or the step's end wakes the loop
            self._scheduled = True
        self._schedule()

    def wake(self) -> None:
        """Schedule the delivery of the events that wait, if any and not yet scheduled."""
        with self._lock:
            if self._scheduled or not self._pending:
                return
            self._scheduled = True
        self._schedule()

    def _schedule(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop closed meanwhile
            with self._lock:
                pending, self._pending = self._pending, []
            for stream, _ in pending:
                stream.cancel()

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._scheduled = False
        for stream, event in pending:
            stream.arrive(event)


class LoopRelays:
    """The relay of each loop that submits requests, made on its first request; those of
    closed loops (say of earlier `asyncio.run`s) are dropped then."""

    def __init__(self) -> None:
        self._relays: dict[asyncio.AbstractEventLoop, LoopRelay] = {}
        self._lock = threading.Lock()
        self._gatherer: int | None = None

    def current(self) -> LoopRelay:
        """The running loop's relay."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if loop not in self._relays:
                self._relays = {other: relay for other, relay in self._relays.items()
                                if not other.is_closed()}
                self._relays[loop] = LoopRelay(loop, self._gathers)
            return self._relays[loop]

    @contextmanager
    def gathering(self) -> Iterator[None]:
        """Within, the events the calling thread puts wait for `wake` (called at each
        turn of the engine's loop and before a step's prompt forward); any left are sent
        on at the end."""
        self._gatherer = threading.get_ident()
        try:
            yield
        finally:
            self._gatherer = None
            self.wake()

    def wake(self) -> None:
        """Wake each loop that has events waiting, once."""
        with self._lock:
            relays = list(self._relays.values())
        for relay in relays:
            relay.wake()

    def _gathers(self) -> bool:
        return self._gatherer == threading.get_ident()


class RequestStream:
    """Async iterator over one request's events: `TokenEvent`s, then one `Finish`.

    Raises the engine's error (e.g. `RequestFailed`) instead of finishing when the
    engine fails the request. Events arrive from the engine's thread through `push`."""

    def __init__(self, request_id: str, relay: Relay,
                 cancel: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._relay = relay
        self._cancel = cancel
        # A deque and one waiter rather than an asyncio.Queue, whose put and get cost
        # several times as much Python: this runs once per streamed token on the loop.
        self._events: deque[object] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._done = False

    def push(self, event: object) -> None:
        """Called from the engine's thread."""
        self._relay.put(self, event)

    def arrive(self, event: object) -> None:
        """Called on the caller's loop, by the relay."""
        self._events.append(event)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def cancel(self) -> None:
        """Ask the engine to end this request (a no-op once it has ended)."""
        self._cancel(self.request_id)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent | Finish:
        if self._done:
            raise StopAsyncIteration
        while not self._events:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        event = self._events.popleft()
        if isinstance(event, BaseException):
            self._done = True
            raise event
        if isinstance(event, Finish):
            self._done = True
        return event  # type: ignore[return-value]
