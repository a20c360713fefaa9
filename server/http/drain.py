"""Graceful shutdown: the drain state the middleware, the routes' jobs and the server
loop share."""

from __future__ import annotations

import time
from typing import Protocol

from server.http.errors import APIError

# After the deadline's cancellations, how long responses get to end before we stop anyway.
CANCEL_GRACE_SECONDS = 2.0
# After the deadline's cancellations, how long a job's engine gets to end its work before
# its responses end without the engine's word (a hung step, or steps of seconds on an
# overloaded machine): within the grace above, so they end with their error event.
ABANDON_SECONDS = 1.0
# What a client the stopping server turns away waits before asking again: the service
# manager starts the server again, or a router sends the retry to another replica.
RESTART_RETRY_SECONDS = 5


def shutting_down() -> APIError:
    """The 503 for a request the stopping server turns away or cuts short (a stream that
    has begun carries it as its error event, without the header)."""
    return APIError(503, "the server is shutting down", code="shutting_down",
                    headers={"Retry-After": str(RESTART_RETRY_SECONDS)})


class DrainJob(Protocol):
    def cancel(self) -> None:
        """Stop the work: the responses waiting on it end once it has stopped."""

    def abandon(self) -> None:
        """End the responses waiting on the work now, whether it has stopped or not."""


class Drain:
    """Once begun, new requests get 503 while in-flight ones run until they finish or the
    deadline passes, when their engine work (`jobs`) is cancelled, which ends their
    responses (with an error) within a few engine steps, or, where the engine does not
    answer by `ABANDON_SECONDS` later, without it."""

    def __init__(self) -> None:
        self.draining = False
        self.hurried = False
        self.inflight = 0
        self.jobs: set[DrainJob] = set()
        self._deadline = 0.0

    def begin(self, timeout: float) -> None:
        self.draining = True
        self._deadline = time.monotonic() + timeout

    def hurry(self) -> None:
        """End what is in flight now, as the deadline would (a second signal): each
        response ends with its error event at the next poll, where a forced exit would cut
        it mid-chunk with none (and log a traceback for each)."""
        self.hurried = True
        self._deadline = time.monotonic() - ABANDON_SECONDS

    def finished(self) -> bool:
        """Polled by the server loop after `begin`: True once it may stop."""
        now = time.monotonic()
        if self.inflight == 0 or now > self._deadline + CANCEL_GRACE_SECONDS:
            return True
        if now > self._deadline:
            for job in list(self.jobs):
                job.cancel()
        if now > self._deadline + ABANDON_SECONDS:
            for job in list(self.jobs):
                job.abandon()
        return False
