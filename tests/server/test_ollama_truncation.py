"""Ollama's truncation of a prompt too long for the context window (its `truncate`,
true unless said): a chat loses its oldest messages, its system messages and its last
message staying; what still does not fit, and a prompt to /api/generate, keeps its first
num_keep tokens and as many of its last as leave half the rest of the window to the
reply, as Ollama's runner cuts it. `truncate: false` refuses it. On the tiny demo model
with a 256-token window."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.support import ServerProcess, start_server

CONTEXT = 256
MODEL = "tiny"
SYSTEM = [{"role": "system", "content": "Answer in one word."}]
TURNS = [message for n in range(12) for message in (
    {"role": "user", "content": f"question {n}: " + "tell me more about it " * 4},
    {"role": "assistant", "content": f"answer {n}: " + "it is what it is " * 4})]
LAST = [{"role": "user", "content": "and finally?"}]
# Ollama's runner: num_keep (4) tokens, then the end, leaving half the rest to the reply.
CUT = CONTEXT - (CONTEXT - 4) // 2


@pytest.fixture(scope="module")
def short_server(demo_model_dir: Path, tmp_path_factory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("ollama-truncation") / "server.log"
    server = start_server(demo_model_dir, log, "--context-length", str(CONTEXT),
                          "--served-model-name", MODEL)
    yield server
    server.stop()


def chat(server: ServerProcess, messages: list[dict], **more) -> httpx.Response:
    return httpx.post(f"{server.url}/api/chat", timeout=120, json={
        "model": MODEL, "messages": messages, "stream": False,
        "options": {"temperature": 0, "num_predict": 2}, **more})


def generate(server: ServerProcess, prompt: str, **more) -> httpx.Response:
    return httpx.post(f"{server.url}/api/generate", timeout=120, json={
        "model": MODEL, "prompt": prompt, "stream": False,
        "options": {"temperature": 0, "num_predict": 2}, **more})


def test_a_chat_over_the_window_loses_its_oldest_messages_not_its_system_ones(
        short_server: ServerProcess) -> None:
    answered = chat(short_server, SYSTEM + TURNS + LAST)
    assert answered.status_code == 200, answered.text
    # Ollama's rule: the first start whose messages, after the system ones, fit.
    for start in range(len(TURNS) + 1):
        alone = chat(short_server, SYSTEM + TURNS[start:] + LAST, truncate=False)
        if alone.status_code == 200:
            break
    assert 0 < start < len(TURNS)
    assert alone.json()["prompt_eval_count"] == answered.json()["prompt_eval_count"] < CONTEXT


def test_truncate_false_refuses_a_prompt_over_the_window(short_server: ServerProcess) -> None:
    for refused in (chat(short_server, SYSTEM + TURNS + LAST, truncate=False),
                    generate(short_server, "word " * 400, truncate=False)):
        assert refused.status_code == 400
        assert "maximum context length" in refused.json()["error"]


def test_a_prompt_over_the_window_is_cut_in_its_middle(short_server: ServerProcess) -> None:
    for answered in (generate(short_server, "word " * 400),
                     generate(short_server, "word " * 400, raw=True),
                     chat(short_server, SYSTEM + [{"role": "user", "content": "word " * 400}])):
        assert answered.status_code == 200, answered.text
        assert answered.json()["prompt_eval_count"] == CUT
