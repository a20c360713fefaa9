"""Ollama's truncation of a prompt too long for the context window (its `truncate`,
true unless said): a chat loses its oldest messages, its system messages and its last
message staying; what still does not fit, and a prompt to /api/generate, keeps its first
num_keep tokens and as many of its last as leave half the rest of the window to the
reply, as Ollama's runner cuts it. `truncate: false` refuses it. The window is the
request's num_ctx where it is smaller than the model's. On the tiny demo model with a
256-token window."""

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


# Past what the window's tokens could hold at the tokenizer's longest token: refused as
# too long before it is encoded, where nothing cuts it.
FAR_PAST = "word " * 20_000


@pytest.mark.parametrize("words", ["word " * 400, FAR_PAST], ids=["over", "far past"])
def test_a_prompt_over_the_window_is_cut_in_its_middle(short_server: ServerProcess,
                                                       words: str) -> None:
    for answered in (generate(short_server, words),
                     generate(short_server, words, raw=True),
                     chat(short_server, SYSTEM + [{"role": "user", "content": words}])):
        assert answered.status_code == 200, answered.text
        assert answered.json()["prompt_eval_count"] == CUT


def test_a_chat_loses_an_old_message_too_long_to_encode(short_server: ServerProcess) -> None:
    answered = chat(short_server, SYSTEM + [{"role": "user", "content": FAR_PAST},
                                            *TURNS[-2:], *LAST])
    assert answered.status_code == 200, answered.text
    alone = chat(short_server, SYSTEM + TURNS[-2:] + LAST, truncate=False)
    assert answered.json()["prompt_eval_count"] == alone.json()["prompt_eval_count"]
    refused = chat(short_server, SYSTEM + [{"role": "user", "content": FAR_PAST}],
                   truncate=False)
    assert refused.status_code == 400
    assert "prompt has at least " in refused.json()["error"]


# Ollama runs a request in a context of num_ctx tokens (the model's when more).
NUM_CTX = 96


def test_num_ctx_is_the_window_a_chat_is_truncated_to(short_server: ServerProcess) -> None:
    small = {"temperature": 0, "num_predict": 2, "num_ctx": NUM_CTX}
    answered = chat(short_server, SYSTEM + TURNS + LAST, options=small)
    assert answered.status_code == 200, answered.text
    # The first start whose messages fit num_ctx, not the model's window.
    for start in range(len(TURNS) + 1):
        alone = chat(short_server, SYSTEM + TURNS[start:] + LAST, truncate=False,
                     options=small)
        if alone.status_code == 200:
            break
    assert alone.json()["prompt_eval_count"] == answered.json()["prompt_eval_count"] < NUM_CTX
    whole_window = chat(short_server, SYSTEM + TURNS + LAST)
    assert answered.json()["prompt_eval_count"] < whole_window.json()["prompt_eval_count"]
    refused = chat(short_server, SYSTEM + TURNS + LAST, truncate=False, options=small)
    assert refused.status_code == 400
    assert f"maximum context length is {NUM_CTX} tokens" in refused.json()["error"]


def test_num_ctx_cuts_a_prompt_and_bounds_the_reply(short_server: ServerProcess) -> None:
    cut = generate(short_server, "word " * 400,
                   options={"temperature": 0, "num_predict": 2, "num_ctx": NUM_CTX})
    assert cut.status_code == 200, cut.text
    assert cut.json()["prompt_eval_count"] == NUM_CTX - (NUM_CTX - 4) // 2
    # No num_predict, -1 or one past the room: the reply ends where num_ctx is full.
    prompt = "word " * 60
    for limit in ({}, {"num_predict": -1}, {"num_predict": 200}):
        replied = generate(short_server, prompt, raw=True,
                           options={"temperature": 0, "num_ctx": NUM_CTX, **limit}).json()
        assert replied["prompt_eval_count"] + replied["eval_count"] <= NUM_CTX, replied
        assert replied["done_reason"] == "length"


def test_a_num_ctx_past_the_models_is_the_models(short_server: ServerProcess) -> None:
    big = chat(short_server, SYSTEM + TURNS + LAST,
               options={"temperature": 0, "num_predict": 2, "num_ctx": 100_000})
    assert big.status_code == 200, big.text
    assert big.json()["prompt_eval_count"] == chat(
        short_server, SYSTEM + TURNS + LAST).json()["prompt_eval_count"]
