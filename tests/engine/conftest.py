"""Engines on tiny generated models of three cache kinds, and their references."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine.demo_model import build_demo_model
from engine.engine import Engine
from tests.engine.support import Reference, start_engine


@pytest.fixture(scope="session")
def family_model_dir(tmp_path_factory):
    built: dict[str, str] = {}

    def build(family: str) -> str:
        if family not in built:
            built[family] = str(build_demo_model(tmp_path_factory.mktemp(family), family=family))
        return built[family]

    return build


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
