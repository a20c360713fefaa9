"""Prefill-only calls (classify, embeddings, rerank) from many clients at once wait their
turn in the server instead of filling the engine's queue: no 429 for them or for a chat
request meanwhile, and each answer is what the call gets alone."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.support import ServerProcess, start_server

MAX_QUEUE = 8
CALLS = 6
INPUTS = 20  # each call alone is over the queue's length: 6 x 20 prompts at once


@pytest.fixture(scope="module")
def short_queue_server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                       ) -> Iterator[ServerProcess]:
    process = start_server(demo_model_dir, tmp_path_factory.mktemp("queue") / "server.log",
                           "--max-queue", str(MAX_QUEUE))
    yield process
    process.stop()


def texts(call: int) -> list[str]:
    return [f"Call {call}, sentence {i}: the weather today is" for i in range(INPUTS)]


async def classify(client: httpx.AsyncClient, call: int) -> httpx.Response:
    return await client.post("/v1/classify", json={"input": texts(call)})


async def everyone_at_once(url: str) -> tuple[list[httpx.Response], httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        chat = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
        *lists, chatted = await asyncio.gather(
            *(classify(client, call) for call in range(CALLS)), chat)
    return lists, chatted


def test_many_classify_calls_at_once_wait_their_turn(short_queue_server: ServerProcess
                                                     ) -> None:
    lists, chatted = asyncio.run(everyone_at_once(short_queue_server.url))
    assert [r.status_code for r in lists] == [200] * CALLS, [r.text for r in lists]
    assert chatted.status_code == 200, chatted.text
    with httpx.Client(base_url=short_queue_server.url, timeout=300) as client:
        for call, response in enumerate(lists):
            alone = client.post("/v1/classify", json={"input": texts(call)})
            assert alone.status_code == 200, alone.text
            assert ([d["token_id"] for d in response.json()["data"]]
                    == [d["token_id"] for d in alone.json()["data"]])
