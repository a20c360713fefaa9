"""One request's many choices share the batch with other requests: a short chat sent
while they run starts at the next free row, not after every one of them. A reply with no
limit holds KV room for what it may write soon, not for the whole context window."""

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
ROOM = 12_000  # KV tokens: less than two of the demo model's 8,192-token windows


@pytest.fixture(scope="module")
def two_row_server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[ServerProcess]:
    process = start_server(demo_model_dir, tmp_path_factory.mktemp("rows") / "server.log",
                           "--max-batch-size", str(ROWS), "--max-tokens-in-flight", str(ROOM))
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


async def first_writes_after_second_starts(url: str, model: str) -> bool:
    """Whether an Ollama chat with no num_predict goes on writing after a second such
    chat, sent once it streamed, wrote its first line (by the lines' server times)."""
    body = {"model": model, "messages": [{"role": "user", "content": "Tell a story."}],
            "stream": True, "options": {"temperature": 0}}
    async with (httpx.AsyncClient(base_url=url, timeout=120) as client,
                client.stream("POST", "/api/chat", json=body) as first):
        lines = first.aiter_lines()
        await anext(lines)
        async with client.stream("POST", "/api/chat", json=body) as second:
            started = json.loads(await anext(second.aiter_lines()))["created_at"]
            async for line in lines:
                written = json.loads(line)
                if written["done"]:
                    return False
                if written["created_at"] > started:
                    return True
    return False


def test_a_reply_without_a_limit_does_not_hold_the_whole_window(
        two_row_server: ServerProcess, demo_model_dir: Path) -> None:
    # Each may write to the end of its window: counted at all of it, two did not fit the
    # room, and the second started once the first was done.
    assert asyncio.run(first_writes_after_second_starts(two_row_server.url, demo_model_dir.name))
