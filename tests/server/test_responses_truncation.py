"""The Responses API's `truncation`: "auto" drops the oldest turns of a conversation that
would not fit the context window, as few as leave room to answer; "disabled" (the
default) refuses it. On the tiny demo model with a 256-token window."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.support import ServerProcess, start_server

CONTEXT = 256
INSTRUCTIONS = "Answer in one word."


@pytest.fixture(scope="module")
def short_server(demo_model_dir: Path, tmp_path_factory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("truncation") / "server.log"
    server = start_server(demo_model_dir, log, "--context-length", str(CONTEXT))
    yield server
    server.stop()


def turn(n: int) -> list[dict]:
    return [{"role": "user", "content": f"question {n}: " + "tell me more about it " * 4},
            {"role": "assistant", "content": f"answer {n}: " + "it is what it is " * 4}]


TURNS = [message for n in range(12) for message in turn(n)]
LAST = [{"role": "user", "content": "and finally?"}]


def respond(server: ServerProcess, messages: list[dict], truncation: str | None = None,
            **more) -> httpx.Response:
    body = {"instructions": INSTRUCTIONS, "input": messages,
            "max_output_tokens": 16, "temperature": 0, **more}
    if truncation is not None:
        body["truncation"] = truncation
    return httpx.post(f"{server.url}/v1/responses", json=body, timeout=120)


def test_disabled_refuses_a_conversation_over_the_window(short_server):
    for truncation in (None, "disabled"):
        refused = respond(short_server, TURNS + LAST, truncation)
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "context_length_exceeded"


def assert_auto_kept_the_latest_that_fit(server: ServerProcess, before: list[dict],
                                        pairs: list[dict], after: list[dict], **more) -> None:
    """`truncation: "auto"` on before + pairs + after kept before, after and the most of
    the latest pairs (two items each) that fit: counted by sending them alone with
    truncation disabled, the same prompt, which the first request left in the cache."""
    answered = respond(server, before + pairs + after, "auto", **more)
    assert answered.status_code == 200, answered.text
    usage = answered.json()["usage"]
    for kept in range(len(pairs) // 2, -1, -1):
        alone = respond(server, before + pairs[len(pairs) - 2 * kept:] + after, **more)
        if alone.status_code == 200:
            break
    assert 0 < kept < len(pairs) // 2
    same = alone.json()["usage"]
    assert same["input_tokens"] == usage["input_tokens"] < CONTEXT
    assert same["input_tokens_details"]["cached_tokens"] >= same["input_tokens"] - 1


def test_auto_keeps_the_instructions_and_the_latest_turns_that_fit(short_server):
    assert_auto_kept_the_latest_that_fit(short_server, [], TURNS, LAST)


def exchange(n: int) -> list[dict]:
    return [{"type": "function_call", "call_id": f"call_{n}", "name": "shell",
             "arguments": '{"command": "ls ' + "dir/" * 6 + f'{n}"}}'},
            {"type": "function_call_output", "call_id": f"call_{n}",
             "output": "file.txt " * 8}]


# As Codex sends its tools: not strict, so the schema is shown as written (a strict one's
# normalized form would leave this 256-token window no room for the task and one call).
SHELL = [{"type": "function", "name": "shell", "strict": False, "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}}}]
TASK = [{"role": "user", "content": "list every file"}]
EXCHANGES = [item for n in range(10) for item in exchange(n)]


def test_auto_drops_an_agents_oldest_tool_exchanges_and_keeps_its_task(short_server):
    """An agent's loop is one turn: its task, then call after call. What goes is the
    oldest calls with their results; the task stays."""
    assert_auto_kept_the_latest_that_fit(short_server, TASK, EXCHANGES, [], tools=SHELL)


def test_a_conversation_that_fits_is_sent_whole(short_server):
    short = TURNS[-2:] + LAST
    auto = respond(short_server, short, "auto").json()["usage"]
    disabled = respond(short_server, short).json()["usage"]
    assert auto["input_tokens"] == disabled["input_tokens"]


def test_the_stored_response_keeps_every_item(short_server):
    answered = respond(short_server, TURNS + LAST, "auto", store=True).json()
    items = httpx.get(f"{short_server.url}/v1/responses/{answered['id']}/input_items",
                      params={"limit": 100}, timeout=30).json()
    assert len(items["data"]) == len(TURNS + LAST)
    follow_up = respond(short_server, [{"role": "user", "content": "more?"}], "auto",
                        previous_response_id=answered["id"])
    assert follow_up.status_code == 200, follow_up.text


def test_a_last_turn_over_the_window_is_refused_still(short_server):
    refused = respond(short_server, [{"role": "user", "content": "word " * CONTEXT}], "auto")
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "context_length_exceeded"
