"""The registry's watch over its models (idle unloads, crashed engines) outlives whatever
goes wrong with one of them: a server left running for months relies on it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.api import Lifecycle
from server import model_registry
from server.config import ModelSpec, Settings
from server.http.errors import APIError
from server.model_registry import WATCH_SECONDS, ModelRegistry, ModelState


class IdleEngine:
    """A loaded model's engine that nothing uses, as far as the watch can tell."""

    state = Lifecycle.READY
    served = True

    def shutdown(self) -> None:
        pass


async def test_a_model_taken_as_it_unloads_does_not_end_the_watch() -> None:
    settings = Settings(models=[ModelSpec(id=name, source=f"/models/{name}", idle_timeout=0.01)
                                for name in ("a", "b")])
    registry = ModelRegistry(settings, None, 1 << 30)
    for model in registry.models:
        model.engine = IdleEngine()
    unload, refused = registry.unload, []

    async def taken_once(model) -> None:
        # A request took the model while its guesses were being cancelled.
        if not refused:
            refused.append(model.id)
            raise APIError(409, f"the model {model.id} has 1 requests in flight")
        await unload(model)

    registry.unload = taken_once
    registry.start()
    try:
        await asyncio.sleep(WATCH_SECONDS * 3)
        assert refused == ["a"]
        assert [model.engine for model in registry.models] == [None, None]
    finally:
        registry.stop_watching()


class DeadEngine:
    """An engine whose process died as it loaded (killed again, or broken files)."""

    state = Lifecycle.FAILED
    error = "the engine process died (killed by SIGKILL)"
    served = False
    disk = None

    def shutdown(self) -> None:
        pass


class ReadyEngine(IdleEngine):
    disk = None
    context_length = 8192
    model_path = None
    tokenizer = None
    is_cross_encoder = False


async def test_a_pinned_model_whose_load_fails_is_loaded_again_until_it_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No request need name it: /health, 503 while a pinned model is down, recovers."""
    monkeypatch.setattr(model_registry, "PINNED_RETRY_SECONDS",
                        (WATCH_SECONDS, 4 * WATCH_SECONDS))
    starts: list[str] = []

    def start_engine(spec: ModelSpec, settings: Settings, share: int) -> object:
        starts.append(spec.id)
        return DeadEngine() if len(starts) <= 3 else ReadyEngine()

    settings = Settings(models=[ModelSpec(id="a", source="/models/a", pinned=True),
                                ModelSpec(id="b", source="/models/b")])
    registry = ModelRegistry(settings, start_engine, 1 << 30)
    pinned, other = registry.models
    registry.start()
    try:
        for _ in range(200):
            await asyncio.sleep(WATCH_SECONDS / 2)
            if pinned.state is ModelState.LOADED:
                break
        assert pinned.state is ModelState.LOADED and pinned.last_error is None
        assert starts == ["a"] * 4  # the unpinned model waits for a request
        assert other.engine is None
    finally:
        registry.stop_watching()


class SlowToStopEngine(ReadyEngine):
    """A loaded engine whose process takes until `stopped` is set to exit."""

    def __init__(self) -> None:
        self.stopped = threading.Event()

    def shutdown(self) -> None:
        self.stopped.wait(30)


async def test_an_engine_still_stopping_holds_its_share_of_the_budget() -> None:
    """A model unloaded while its process was still loading took as long as that load to
    stop, and the next model's engine started beside it: with room for one, both models'
    weights in memory."""
    started: list[str] = []

    def start_engine(spec: ModelSpec, settings: Settings, share: int) -> object:
        started.append(spec.id)
        return ReadyEngine()

    settings = Settings(models=[ModelSpec(id=name, source=f"/models/{name}",
                                          memory_bytes=1 << 30) for name in ("a", "b")],
                        load_timeout=30)
    registry = ModelRegistry(settings, start_engine, (1 << 30) + (1 << 29))
    stopping = registry.models[0]
    engine = stopping.engine = SlowToStopEngine()
    unload = asyncio.create_task(registry.unload(stopping))
    await asyncio.sleep(WATCH_SECONDS)
    lease = asyncio.create_task(registry.acquire("b"))
    await asyncio.sleep(WATCH_SECONDS * 2)
    assert started == [] and not lease.done()  # no room while the process stops
    engine.stopped.set()
    await unload
    (await lease).release()
    assert started == ["b"]
