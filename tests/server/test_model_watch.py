"""The registry's watch over its models (idle unloads, crashed engines) outlives whatever
goes wrong with one of them: a server left running for months relies on it."""

from __future__ import annotations

import asyncio

from engine.api import Lifecycle
from server.config import ModelSpec, Settings
from server.http.errors import APIError
from server.model_registry import WATCH_SECONDS, ModelRegistry


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
