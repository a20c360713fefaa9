"""A chat's next turn finds its last reply cached as the template renders it back, not
only as the tokens that were generated (server/next_turn.py).

The demo model's random replies re-encode to other tokens, and a tool call comes back in
the template's own JSON: without the prefill, the next turn's cache match ends inside
the reply. The cache-miss details say where each turn stopped matching.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.loader import load_tokenizer
from server.events import ChoiceResult, ToolCall
from server.follow_ups import MIN_SEEN
from server.next_turn import DELAY_SECONDS, next_turn_prompt
from server.openai.adapter import chat_request
from server.openai.protocol import ChatCompletionRequest
from server.prompts import chat_prompt
from server.request import GenerationRequest
from tests.server.support import ServerProcess, start_server, wait_idle
from tests.server.thinking_model import build_thinking_model

SYSTEM = "You are a coding agent. Read files and answer briefly. " * 4
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]
METRIC = "radix_mlx_next_turn_prefilled_tokens_total"


def start(model: Path, directory: Path, prefill: bool) -> ServerProcess:
    return start_server(model, directory / "server.log", "--cache-miss-details", "true",
                        "--prefill-next-turn", str(prefill).lower())


@pytest.fixture(scope="module")
def servers(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[bool, ServerProcess]]:
    """With the next turn's prefill (the default) and without."""
    on = start(demo_model_dir, tmp_path_factory.mktemp("next-turn-on"), True)
    off = start(demo_model_dir, tmp_path_factory.mktemp("next-turn-off"), False)
    yield {True: on, False: off}
    on.stop()
    off.stop()


def prefilled(server: ServerProcess) -> float:
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    return next(float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith(METRIC))


def turn(server: ServerProcess, messages: list[dict], wait: bool = True, **extra) -> dict:
    """One chat turn's response; with `wait`, once the server has prefilled the next
    (if the reply asks for it: the tokens may come back as they were generated)."""
    if wait:
        wait_idle(server)  # an earlier reply's guess, ending now, would count as this one's
    before = prefilled(server)
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": served_model(server), "messages": messages, "max_tokens": 24,
        "temperature": 0, **extra})
    assert response.status_code == 200, response.text
    deadline = time.monotonic() + 10
    while wait and prefilled(server) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    return response.json()


def served_model(server: ServerProcess) -> str:
    return httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]


def miss_after(body: dict) -> str:
    """The prompt's text from where the cache stopped matching it."""
    return body["usage"]["prompt_tokens_details"]["cache_miss"]["after"]


@pytest.mark.parametrize("prefill", [True, False])
def test_the_next_turn_misses_only_at_its_own_text(servers, prefill: bool) -> None:
    server = servers[prefill]
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Describe the layout ({prefill})."}]
    first = turn(server, messages, wait=prefill)
    reply = first["choices"][0]["message"]["content"]
    messages += [{"role": "assistant", "content": reply},
                 {"role": "user", "content": "Which file is the largest?"}]
    second = turn(server, messages, wait=False)
    # Without the prefill, the random reply encoded again is not what was generated, or
    # its turn's end was never generated (the reply ran out of tokens).
    assert miss_after(second).lstrip().startswith("Which file is the largest?") == prefill
    assert (prefilled(server) > 0) == prefill


def test_a_chat_sent_again_finds_its_next_turn_already_cached(servers) -> None:
    """A client resending a chat (a retry, a regenerate) gets the same greedy reply, whose
    next turn the first reply's prefill already cached: the second prefill computes
    nothing (it used to cost a forward of its own, and 64 at once stalled the engine for
    half a second on a GPU)."""
    server = servers[True]
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "List the files twice."}]
    first = turn(server, messages)
    assert prefilled(server) > 0
    before = server.metrics()
    again = turn(server, messages, wait=False)
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    # The reply's own prompt, then its next turn's: both counted once they finish.
    deadline = time.monotonic() + 10
    while (server.metrics()["radix_mlx_prompt_tokens_total"]
           <= before["radix_mlx_prompt_tokens_total"] + again["usage"]["prompt_tokens"]
           and time.monotonic() < deadline):
        time.sleep(0.05)
    after = wait_idle(server)
    assert after[METRIC] == before[METRIC]
    usage = again["usage"]
    own = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    assert (after["radix_mlx_prefill_tokens_total"]
            == before["radix_mlx_prefill_tokens_total"] + own)


def test_a_tool_call_comes_back_cached_up_to_its_result(servers) -> None:
    server = servers[True]
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Read the readme."}]
    first = turn(server, messages, tools=TOOLS, max_tokens=64,
                 tool_choice={"type": "function", "function": {"name": "read_file"}})
    message = first["choices"][0]["message"]
    (call,) = message["tool_calls"]
    messages += [{"role": "assistant", "content": message["content"], "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": call["id"], "content": "Forty-two lines."}]
    second = turn(server, messages, wait=False, tools=TOOLS)
    assert miss_after(second).lstrip().startswith("Forty-two lines.")


def test_the_guess_is_how_every_next_turn_begins(demo_model_dir: Path, tmp_path: Path) -> None:
    """Whatever the next turn says, its prompt starts with the tokens prefilled for it:
    after a plain reply, a reply of tool calls, and a thinking model's reply (its template
    drops reasoning once a turn follows)."""
    thinking = build_thinking_model(demo_model_dir, tmp_path / "thinking")
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi."}]
    call = {"id": "c1", "type": "function",
            "function": {"name": "read_file", "arguments": '{"path":"a"}'}}
    cases = [
        (demo_model_dir, {"role": "assistant", "content": " a reply  \n"},
         {"role": "user", "content": "Next question, please."}),
        (demo_model_dir, {"role": "assistant", "content": None, "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "c1", "content": "x = 1"}),
        (thinking, {"role": "assistant", "content": "Done."},
         {"role": "user", "content": "And?"}),
    ]
    for model, assistant, follow in cases:
        tokenizer = load_tokenizer(model)
        reply = ChoiceResult(text=assistant["content"] or "", tool_calls=[
            ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in assistant.get("tool_calls", ())])
        guess = next_turn_prompt(tokenizer, as_request(history), (), reply,
                                 message_ends=False).tokens
        actual = chat_prompt(tokenizer, as_request([*history, assistant, follow])).tokens
        assert actual[:len(guess)] == guess
        assert len(guess) > len(chat_prompt(tokenizer, as_request(history)).tokens)


def as_request(messages: list[dict]) -> GenerationRequest:
    """`messages` as a client sends them to /v1/chat/completions."""
    return chat_request(ChatCompletionRequest.model_validate(
        {"model": "demo", "messages": messages, "tools": TOOLS}))


def test_a_snapshot_model_guesses_only_while_nothing_else_runs(
        demo_model_family, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Gemma 3's sliding layers: each prompt is a forward of its own, so a guess waits
    for an idle engine rather than delay the prompts of others."""
    server = start(demo_model_family("gemma3_text"), tmp_path_factory.mktemp("gemma"), True)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Describe the layout."}]
    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120, json={
                "prompt": "count:", "max_tokens": 4000, "ignore_eos": True,
                "stream": True}) as busy:
            lines = busy.iter_lines()  # held: a dropped iterator closes the stream
            next(lines)
            turn(server, messages, wait=False)
            assert prefilled(server) == 0
        turn(server, [*messages[:1], {"role": "user", "content": "List the files."}])
        assert prefilled(server) > 0
    finally:
        server.stop()


def test_one_shot_chats_stop_the_guesses_and_a_conversation_brings_them_back(
        demo_model_dir: Path, tmp_path: Path) -> None:
    """Where chats end after one turn, every guess is a forward nobody reads: once most of
    the last chats carried no earlier reply, replies are not prefilled as next turns; a
    few chats that come back turn it on again (server/follow_ups.py)."""
    server = start(demo_model_dir, tmp_path, True)
    system = {"role": "system", "content": SYSTEM}
    try:
        for index in range(MIN_SEEN):
            turn(server, [system, {"role": "user", "content": f"One question ({index})."}],
                 wait=False)
        messages = [system, {"role": "user", "content": "Describe the layout."}]
        first = turn(server, messages, wait=False)
        wait_idle(server)  # a guess, had one been made, would have run by now
        messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Which file is the largest?"}]
        second = turn(server, messages, wait=False)
        assert not miss_after(second).lstrip().startswith("Which file is the largest?")
        messages += [{"role": "assistant", "content": second["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "And the smallest?"}]
        third = turn(server, messages)  # two chats of eleven continued: guessed again
        messages += [{"role": "assistant", "content": third["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Thanks."}]
        assert miss_after(turn(server, messages, wait=False)).lstrip().startswith("Thanks.")
    finally:
        server.stop()


def test_a_clear_right_after_a_reply_keeps_nothing_of_its_guess(servers) -> None:
    """An operator's clear sent as a reply ends: the reply's next-turn guess, whether
    still waiting, being rendered or already prefilling, is cancelled before the clear
    runs, so it cannot put its chat back in the tree after it (it used to in about a
    third of such clears)."""
    server = servers[True]
    for session in range(8):
        messages = [{"role": "system", "content": f"Session {session}. {SYSTEM}"}]
        for question in ("Describe the layout.", "Which file is the largest?", "Why?"):
            messages.append({"role": "user", "content": question})
            reply = turn(server, messages, wait=False, max_tokens=6)
            messages.append({"role": "assistant",
                             "content": reply["choices"][0]["message"]["content"]})
        # While the last reply's guess waits, is being rendered, or is prefilling.
        time.sleep(session % 4 * DELAY_SECONDS / 2)
        assert httpx.delete(f"{server.url}/admin/cache", timeout=30).status_code == 200
        wait_idle(server)  # a guess that outlived the clear would have run by now
        memory = httpx.get(f"{server.url}/admin/cache", timeout=30).json()["memory"]
        assert (session, memory["tokens"]) == (session, 0)
