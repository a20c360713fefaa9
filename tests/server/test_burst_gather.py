"""Requests sent together are computed together: an idle model waits for those the server
is still preparing for it, and only for those. Here it would wait ten minutes, so a request
that left its count behind (refused in its preparation) would hold every later one."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.support import ServerProcess, start_server

CHAT = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 4}


@pytest.fixture(scope="module", params=[False, True], ids=["in-process", "engine-process"])
def gathering_server(request: pytest.FixtureRequest, demo_model_dir: Path,
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = start_server(demo_model_dir, tmp_path_factory.mktemp("gather") / "server.log",
                           "--burst-gather-ms", "600000",
                           "--engine-process", str(request.param).lower())
    yield process
    process.stop()


def test_requests_refused_while_being_prepared_hold_nobody(gathering_server: ServerProcess
                                                           ) -> None:
    with httpx.Client(base_url=gathering_server.url, timeout=60) as client:
        refused = [
            client.post("/v1/chat/completions", json={**CHAT, "logit_bias": {"99999999": 1}}),
            client.post("/v1/chat/completions", json={
                **CHAT, "messages": [{"role": "user", "content": "word " * 100_000}]}),
        ]
        assert [r.status_code for r in refused] == [400, 400], [r.text for r in refused]
        answered = client.post("/v1/chat/completions", json=CHAT)
    assert answered.status_code == 200, answered.text


async def test_requests_sent_together_are_all_answered(gathering_server: ServerProcess
                                                       ) -> None:
    async with httpx.AsyncClient(base_url=gathering_server.url, timeout=60) as client:
        answers = await asyncio.gather(*(
            client.post("/v1/chat/completions", json={
                **CHAT, "messages": [{"role": "user", "content": f"Chat {i}: say something."}]})
            for i in range(8)))
    assert [a.status_code for a in answers] == [200] * 8
    assert all(a.json()["choices"][0]["message"]["content"] for a in answers)
