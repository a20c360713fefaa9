"""Engines on tiny generated models of three cache kinds, and their references."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine.engine import Engine
from tests.engine.support import Reference, start_engine


@pytest.fixture(scope="session")
def family_model_dir(demo_model_family):
    """The session's demo model of a family (tests/conftest.py builds each once), as a
    path string."""
    return lambda family: str(demo_model_family(family))


@pytest.fixture(scope="module", params=["llama", "gemma3_text", "qwen3_next"])
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def engine(family, family_model_dir) -> Iterator[Engine]:
    engine = start_engine(family_model_dir(family), cache_bytes=1 << 30)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(family, family_model_dir) -> Reference:
    return Reference(family_model_dir(family))
