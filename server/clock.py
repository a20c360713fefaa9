"""When a generation began, its model was ready and its first token came: the durations
Ollama's and llama.cpp's native answers report (the load, the prompt, the generation)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Durations:
    """Nanoseconds, up to the moment they were read."""

    total: int
    load: int  # from the request to the model being ready
    prompt: int  # from then to the first token
    generation: int  # from the first token on


@dataclass
class Clock:
    started: int = field(default_factory=time.monotonic_ns)
    loaded: int | None = None
    first: int | None = None

    def ready(self) -> None:
        self.loaded = time.monotonic_ns()

    def elapsed(self) -> int:
        return time.monotonic_ns() - self.started

    def token(self) -> None:
        if self.first is None:
            self.first = time.monotonic_ns()

    def durations(self) -> Durations:
        now = time.monotonic_ns()
        loaded = self.loaded or self.started
        first = self.first or now
        return Durations(total=now - self.started, load=loaded - self.started,
                         prompt=first - loaded, generation=now - first)
