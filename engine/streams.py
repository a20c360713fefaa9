"""How a request's events travel from the engine's thread to the asyncio loop that
reads them: the queue-depth gate (`WaitingCount`), the per-loop relays that batch a
step's events into one wake-up (`LoopRelay`, `LoopRelays`) and the async iterator a
caller reads (`RequestStream`). Importable without MLX, like engine/api.py: both the
engine and `EngineProcess` (in the server's process) feed streams through them.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

from engine.api import Finish, QueueFull, TokenEvent


class WaitingCount:
    """Requests submitted and not yet started, by id, at most `limit` (`max_queue`). A
    request leaves once: when the engine starts or ends it, or when it is cancelled,
    whichever comes first. A request refused for a full queue cancels its choices queued
    so far, and their places are free at once, not only when the engine's thread next
    takes its messages (requests that came meanwhile were refused for places nobody
    would use)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._ids: set[str] = set()
        self._lock = threading.Lock()

    @property
    def value(self) -> int:
        return len(self._ids)

    def enter(self, request_ids: Sequence[str]) -> None:
        """Count `request_ids`, or none and raise QueueFull."""
        with self._lock:
            if len(self._ids) + len(request_ids) > self.limit:
                raise QueueFull(f"{len(self._ids)} requests are already waiting",
                                retry_after=1.0)
            self._ids.update(request_ids)

    def leave(self, request_id: str) -> None:
        with self._lock:
            self._ids.discard(request_id)


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


class EventQueue:
    """Items put on an asyncio loop and awaited there by one reader: a deque and one
    waiter rather than an asyncio.Queue, whose put and get cost several times as much
    Python (this runs once per streamed token on the loop)."""

    def __init__(self) -> None:
        self._items: deque[object] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: object) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def popleft(self) -> object:
        """The first item; there must be one."""
        return self._items.popleft()

    async def get(self) -> object:
        """The first item, once there is one."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class RequestStream:
    """Async iterator over one request's events: `TokenEvent`s, then one `Finish`.

    Raises the engine's error (e.g. `RequestFailed`) instead of finishing when the
    engine fails the request. Events arrive from the engine's thread through `push`."""

    def __init__(self, request_id: str, relay: Relay,
                 cancel: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._relay = relay
        self._cancel = cancel
        self._events = EventQueue()
        self._done = False  # the iterator gave its last event
        self._ended = False  # the last event arrived: nothing left to cancel
        self._sink: Callable[[object], None] | None = None

    def forward_to(self, sink: Callable[[object], None]) -> None:
        """Hand `sink` every event instead of the iterator, those waiting first: a reader
        of many streams (a list of prompts) takes them in one place, rather than through
        a task per stream and a second wake-up per event. Called on the caller's loop."""
        self._sink = sink
        while self._events:
            sink(self._events.popleft())

    def push(self, event: object) -> None:
        """Called from the engine's thread."""
        self._relay.put(self, event)

    def arrive(self, event: object) -> None:
        """Called on the caller's loop, by the relay."""
        if isinstance(event, Finish | BaseException):
            self._ended = True
        if self._sink is not None:
            self._sink(event)
            return
        self._events.put(event)

    def end_with(self, error: BaseException) -> None:
        """End the stream here, with `error`, unless it has ended: for a caller that may
        not wait for the engine (a drain's deadline past); what the engine says of the
        request later is read by nobody. Called on the caller's loop."""
        if not self._ended:
            self.arrive(error)

    def cancel(self) -> None:
        """Ask the engine to end this request, unless it has ended (a list's job closes
        every stream it read: a message to the engine for each would be for nothing)."""
        if not self._ended:
            self._cancel(self.request_id)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent | Finish:
        if self._done:
            raise StopAsyncIteration
        # Most events are there already: no coroutine for them.
        event = self._events.popleft() if self._events else await self._events.get()
        if isinstance(event, BaseException):
            self._done = True
            raise event
        if isinstance(event, Finish):
            self._done = True
        return event  # type: ignore[return-value]
