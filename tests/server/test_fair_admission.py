"""One request's many choices share the batch with other requests: a short chat sent
while they run starts at the next free row, not after every one of them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.support import ServerProcess, start_server

ROWS = 2
CHOICES = 12


@pytest.fixture(scope="module")
def two_row_server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[ServerProcess]:
    process = start_server(demo_model_dir, tmp_path_factory.mktemp("rows") / "server.log",
                           "--max-batch-size", str(ROWS))
    yield process
    process.stop()


async def choices_finished_before_a_chat(url: str) -> int:
    """How many of a request's choices had finished when a short chat sent once the first
    of them streamed its first token got its answer."""
    many = {"messages": [{"role": "user", "content": "Tell a story."}], "n": CHOICES,
            "max_tokens": 48, "ignore_eos": True, "stream": True}
    short = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    finished, chat = 0, None
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async with client.stream("POST", "/v1/chat/completions", json=many) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if chat is None:
                    chat = asyncio.create_task(client.post("/v1/chat/completions", json=short))
                elif chat.done():
                    break
                finished += any(c["finish_reason"] for c in json.loads(line[6:])["choices"])
        answered = await chat
    assert answered.status_code == 200, answered.text
    return finished


def test_a_short_chat_waits_for_a_free_row_not_for_every_choice(two_row_server: ServerProcess
                                                                ) -> None:
    # Counted per choice, all of them went first: the chat came after the 12th.
    assert asyncio.run(choices_finished_before_a_chat(two_row_server.url)) <= CHOICES // 2
