"""Real server processes on the tiny demo model, shared by tests.

Each fixture starts one process on a free 127.0.0.1 port and waits for /health to say
ready; a start costs a few seconds, so they are session- or module-scoped. Besides them,
`loading_app` talks to the app in process, its engine never started (so still loading).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine.api import EngineConfig
from engine.engine import Engine
from server.app import create_app
from server.config import Settings
from server.model_registry import ModelRegistry
from tests.server.support import ALIAS, API_KEY, ServerProcess, start_server
from tests.server.thinking_model import build_thinking_model


@pytest.fixture(scope="session")
def server(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The main server: API key required, one alias, default limits."""
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    process = start_server(
        demo_model_dir, log_path, "--api-key", API_KEY, "--served-model-name", ALIAS
    )
    yield process
    process.stop()


@pytest.fixture(scope="session")
def thinking_server(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The demo model with Qwen3's thinking markers and template (`thinking_model`)."""
    directory = tmp_path_factory.mktemp("thinking")
    model = build_thinking_model(demo_model_dir, directory / "tiny-thinking")
    process = start_server(model, directory / "server.log")
    yield process
    process.stop()


@pytest.fixture(scope="session")
def model_id(demo_model_dir: Path) -> str:
    return demo_model_dir.name


@pytest.fixture(scope="session")
def headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
def async_client(server: ServerProcess) -> openai.AsyncOpenAI:
    # Per test: an async client is bound to the event loop it first runs on.
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
async def loading_app() -> AsyncIterator[httpx.AsyncClient]:
    """A client of the app in process, whose engine never starts: it stays loading."""
    app = create_app(Settings(), ModelRegistry.of_one(Settings(), Engine(EngineConfig(model="unused"))))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test.localhost") as client:
        yield client
