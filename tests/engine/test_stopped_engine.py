"""An engine that has stopped answers at once what reaches it after: a request is refused,
a clear fails, and nothing waits for an answer that cannot come. A model's idle unload
stops its engine while the server runs, so a clear or a request can meet one."""

from __future__ import annotations

import pytest

from engine.api import EngineConfig, EngineNotReady, Lifecycle, SamplingParams
from engine.demo_model import demo_model_path
from engine.engine import Engine
from engine.process import EngineProcess
from tests.engine.support import complete


@pytest.mark.parametrize("kind", [Engine, EngineProcess])
async def test_a_stopped_engine_refuses_what_comes_after(kind):
    engine = kind(EngineConfig(model=str(demo_model_path("tiny"))))
    engine.start()
    assert engine.wait_ready(120) is Lifecycle.READY
    assert (await complete(engine, [5, 6, 7], max_tokens=2)).tokens
    engine.shutdown()
    with pytest.raises(EngineNotReady, match="stopped"):
        engine.submit([5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(EngineNotReady, match="stopped"):
        engine.clear_cache().result(timeout=10)
    assert engine.waiting == 0
