"""Engines on tiny generated models of three cache kinds, and their references."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import demo_model
from engine.demo_model import build_demo_model
from engine.engine import Engine
from tests.engine.support import Reference, start_engine


@pytest.fixture(scope="session")
def family_model_dir(demo_model_family):
    """The session's demo model of a family (tests/conftest.py builds each once), as a
    path string."""
    return lambda family: str(demo_model_family(family))


@pytest.fixture(scope="session")
def head64_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny demo llama with heads 64 wide, which kv_group_size 64 tiles (the demo's
    are 16): a quantized engine (`kv_bits`) that starts in a second (the real model's
    three took ~40 s on 2 loaded cores)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(demo_model.SIZES, "tiny-head64", {**demo_model.SIZES["tiny"], "head_dim": 64})
        return build_demo_model(tmp_path_factory.mktemp("head64") / "tiny-head64",
                                size="tiny-head64")


@pytest.fixture(scope="module", params=["llama", "gemma3_text", "qwen3_next"])
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def engine(family, family_model_dir) -> Iterator[Engine]:
    """Warmed up as on a GPU, so the tests of each cache kind also run after a warm-up."""
    engine = start_engine(family_model_dir(family), cache_bytes=1 << 30, warm_up=True)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(family, family_model_dir) -> Reference:
    return Reference(family_model_dir(family))


@pytest.fixture(scope="session")
def real_engine_for_session(real_model_dir) -> Iterator[Engine]:
    """An engine on the real default model, as configured by default (speculation off),
    in this process for the session: its load and warm-up cost ~10 s on 2 cores. Tests use
    `real_engine`."""
    engine = start_engine(str(real_model_dir), cache_bytes=1 << 30)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def real_engine(real_engine_for_session: Engine) -> Engine:
    """The session's real-model engine with its prefix cache emptied for each module that
    asks for it, which then sees it as a fresh engine's: a cold cache."""
    real_engine_for_session.clear_cache().result(timeout=60)
    assert real_engine_for_session.stats().tree.total_tokens == 0
    return real_engine_for_session
