"""Models whose cache is reused only as whole-state snapshots (sliding-window layers:
gemma3_text; recurrent layers beside attention: qwen3_next) share a system prompt
between conversations, and a conversation's turns with its next request, through the
snapshots prefill takes where the chat's messages end; greedy output is the same as on
a cold cache."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from transformers import PreTrainedTokenizerFast

from tests.server.support import ServerProcess, start_server

SYSTEM = {"role": "system", "content": "You are the harbour master's assistant. Answer in "
          "one short sentence, name the berth, the tide and the pilot on duty, and never "
          "guess a ship's arrival time."}


@dataclass(frozen=True)
class Reply:
    text: str
    tokens: list[tuple[str, tuple[int, ...]]]
    cached: int


@pytest.fixture(scope="module", params=["gemma3_text", "qwen3_next"])
def family(request, demo_model_family,
           tmp_path_factory) -> Iterator[tuple[Path, ServerProcess]]:
    model = demo_model_family(request.param)
    process = start_server(model, tmp_path_factory.mktemp(request.param) / "server.log")
    yield model, process
    process.stop()


def chat(server: ServerProcess, messages: list[dict]) -> Reply:
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "messages": messages, "max_tokens": 12, "temperature": 0, "logprobs": True})
    assert response.status_code == 200, response.text
    body = response.json()
    choice = body["choices"][0]
    return Reply(choice["message"]["content"],
                 [(t["token"], tuple(t["bytes"])) for t in choice["logprobs"]["content"]],
                 body["usage"]["prompt_tokens_details"]["cached_tokens"])


def rendered_tokens(model: Path, messages: list[dict]) -> int:
    """How many tokens the template renders for `messages`, no reply started."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model)
    return len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))


def cold(server: ServerProcess, messages: list[dict]) -> Reply:
    assert httpx.delete(f"{server.url}/admin/cache", timeout=30).status_code == 200
    reply = chat(server, messages)
    assert reply.cached == 0
    return reply


def test_a_new_conversation_reuses_the_system_prompt(family) -> None:
    model, server = family
    chat(server, [SYSTEM, {"role": "user", "content": "When is high tide today?"}])
    second = [SYSTEM, {"role": "user", "content": "Which berth is free for the ferry?"}]
    warm = chat(server, second)
    assert warm.cached >= rendered_tokens(model, [SYSTEM])
    assert warm.tokens == cold(server, second).tokens


def test_the_next_turn_reuses_the_conversation(family) -> None:
    model, server = family
    first = [SYSTEM, {"role": "user", "content": "Who is the pilot on duty?"}]
    reply = chat(server, first)
    # The next turn, and a retry of it with another question: both reuse the first.
    for question in ("And tomorrow?", "And at night?"):
        turn = [*first, {"role": "assistant", "content": reply.text},
                {"role": "user", "content": question}]
        warm = chat(server, turn)
        assert warm.cached >= rendered_tokens(model, first)
    assert warm.tokens == cold(server, turn).tokens
