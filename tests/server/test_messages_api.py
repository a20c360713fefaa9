"""Anthropic's Messages API end to end: the official `anthropic` SDK and raw HTTP against
the shared server process on the tiny demo model (random weights: these tests check
shapes, usage and the cache, not what the model says)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Literal

import anthropic
import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from engine.demo_model import CHAT_TEMPLATE, MAX_POSITION_EMBEDDINGS
from engine.loader import load_tokenizer
from server.anthropic.defined_tools import DEFINED_TOOLS
from tests.server.support import API_KEY, ServerProcess, start_server, wait_idle
from tests.server.thinking_model import build_thinking_model


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)


def _billing_line(step: int) -> str:
    """What Claude Code puts first in its system prompt: a hash that changes every request."""
    return f"x-anthropic-billing-header: cc_version=2.1.117.{step:03x}; cc_entrypoint=cli; " \
        f"cch={uuid.uuid4().hex[:5]};"


def _system(step: int, text: str) -> list[dict]:
    return [{"type": "text", "text": _billing_line(step)},
            {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]


GREEDY = {"temperature": 0.0}
TOOLS = [{
    "name": "read_file", "description": "Read a file of the project.",
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}},
                     "required": ["path"]},
}]


def test_message_shape_and_usage(claude: anthropic.Anthropic, model_id: str) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    message = claude.messages.create(model=model_id, max_tokens=5, messages=messages)
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == model_id
    assert [block.type for block in message.content] == ["text"]
    assert message.stop_reason in ("max_tokens", "end_turn")
    assert message.usage.output_tokens == 5 or message.stop_reason == "end_turn"
    # Anthropic counts cache reads apart from input_tokens; together they are the prompt.
    counted = claude.messages.count_tokens(model=model_id, messages=messages).input_tokens
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == counted
    # Claude Code uses the beta namespace: /v1/messages?beta=true, with anthropic-beta.
    beta = claude.beta.messages.create(model=model_id, max_tokens=2, messages=messages,
                                       betas=["interleaved-thinking-2025-05-14"])
    assert beta.usage.cache_read_input_tokens == counted - 1
    # The SDK keeps the id of the request a message answers (request-id), for support.
    assert message._request_id and message._request_id != beta._request_id


def test_stream_events_build_the_same_message(claude: anthropic.Anthropic, model_id: str) -> None:
    # This SDK has no temperature argument (Claude Code still sends one).
    options = {"model": model_id, "max_tokens": 6, "extra_body": GREEDY,
               "system": "You are terse.", "messages": [{"role": "user", "content": "Hello"}]}
    whole = claude.messages.create(**options)
    with claude.messages.stream(**options) as stream:
        kinds = [event.type for event in stream if event.type != "text"]
        streamed = stream.get_final_message()
    deltas = len(kinds) - 5
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"]
    assert streamed.content[0].text == whole.content[0].text
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    total = streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens
    # Same prompt as the whole message's, which is in the cache now.
    assert streamed.usage.cache_read_input_tokens == total - 1


@pytest.fixture(scope="module")
def engine_process_server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                          ) -> Iterator[ServerProcess]:
    """The engine in a process of its own, where a peek at its cache is a round trip."""
    log_path = tmp_path_factory.mktemp("engine_process") / "server.log"
    process = start_server(demo_model_dir, log_path, "--api-key", API_KEY,
                           "--engine-process", "true")
    yield process
    process.stop()


@pytest.mark.parametrize("serving", ["server", "engine_process_server"])
def test_message_start_splits_the_prompt_by_what_the_cache_holds(
        serving: str, model_id: str, request: pytest.FixtureRequest) -> None:
    """message_start's usage already says how much of the prompt the cache holds, as
    Anthropic's does (context meters and cost trackers read it there), the split that
    message_delta then gives. It used to count the whole prompt as uncached."""
    claude = anthropic.Anthropic(base_url=request.getfixturevalue(serving).url,
                                 api_key=API_KEY, max_retries=0)
    options = {"model": model_id, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
               "system": f"You are terse ({uuid.uuid4().hex}). " + "Answer briefly. " * 20}
    splits = []
    for _ in range(2):  # the second's prompt is in the cache, all but its last token
        with claude.messages.stream(**options) as stream:
            events = list(stream)
        (start,) = [event.message.usage for event in events if event.type == "message_start"]
        (end,) = [event.usage for event in events if event.type == "message_delta"]
        assert (start.input_tokens, start.cache_read_input_tokens) == (
            end.input_tokens, end.cache_read_input_tokens)
        splits.append((start.input_tokens, start.cache_read_input_tokens))
    assert splits[1][1] > splits[0][1] and splits[1][0] == 1


def test_raw_stream_names_events_and_pings(server: ServerProcess, model_id: str) -> None:
    body = {"model": model_id, "max_tokens": 2, "stream": True,
            "messages": [{"role": "user", "content": "Hi"}]}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, timeout=60,
                      headers={"x-api-key": API_KEY}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line.startswith("event: ")]
    assert lines[:2] == ["event: message_start", "event: ping"]
    assert lines[-2:] == ["event: message_delta", "event: message_stop"]


def test_tool_use_and_tool_result_history_is_rendered(
    claude: anthropic.Anthropic, model_id: str
) -> None:
    history = [
        {"role": "user", "content": "What is in README.md?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "read_file",
             "input": {"path": "README.md"}}]},
    ]
    result = {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1",
         "content": [{"type": "text", "text": "# radix-mlx, a server " * 20}]}]}
    without = claude.messages.count_tokens(model=model_id, tools=TOOLS, messages=history[:1])
    before = claude.messages.count_tokens(model=model_id, tools=TOOLS, messages=history)
    after = claude.messages.count_tokens(model=model_id, tools=TOOLS, messages=[*history, result])
    assert without.input_tokens < before.input_tokens < after.input_tokens - 100
    message = claude.messages.create(model=model_id, max_tokens=3, tools=TOOLS,
                                     messages=[*history, result])
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == \
        after.input_tokens


def test_billing_line_does_not_defeat_the_cache(claude: anthropic.Anthropic, model_id: str) -> None:
    text = f"You are a coding agent ({uuid.uuid4().hex}). " + "Follow the rules. " * 60
    usages = [
        claude.messages.create(model=model_id, max_tokens=1, system=_system(step, text),
                               messages=[{"role": "user", "content": "Hi"}]).usage
        for step in range(2)
    ]
    assert usages[0].cache_read_input_tokens < 10
    prompt = usages[1].input_tokens + usages[1].cache_read_input_tokens
    assert usages[1].cache_read_input_tokens == prompt - 1


def test_claude_code_shaped_agent_loop_is_served_from_cache(
    claude: anthropic.Anthropic, model_id: str
) -> None:
    """Six steps of a Claude-Code-shaped session: a fresh billing line every request, a long
    system prompt and tools, the history resent with each step's reply and a tool result.
    The share of the prompt read from the cache grows step by step."""
    system = f"You are Claude Code ({uuid.uuid4().hex}). " + "Use the tools well. " * 40
    messages: list[dict] = [{"role": "user", "content": "Fix the failing test."}]
    shares = []
    for step in range(6):
        reply = claude.messages.create(model=model_id, max_tokens=4, extra_body=GREEDY,
                                       system=_system(step, system), tools=TOOLS,
                                       messages=messages)
        usage = reply.usage
        shares.append(usage.cache_read_input_tokens
                      / (usage.input_tokens + usage.cache_read_input_tokens))
        call = {"type": "tool_use", "id": f"toolu_{step}", "name": "read_file",
                "input": {"path": f"src/module_{step}.py"}}
        messages += [
            {"role": "assistant", "content": [*reply.model_dump()["content"], call]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{step}",
                                          "content": f"def f{step}(): return {step}\n" * 12}]},
        ]
    print("Claude-Code-shaped cached share per step:", [f"{share:.2%}" for share in shares])
    assert shares[0] < 0.1
    assert all(later > earlier for earlier, later in pairwise(shares))
    assert all(share >= 0.8 for share in shares[2:])


@pytest.mark.parametrize(("body", "status", "kind", "words"), [
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "iVBORw0KGgo="}}]}]},
     400, "invalid_request_error", "does not read images"),  # a text model
    ({"max_tokens": 4, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "look",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}]}]}]},
     400, "invalid_request_error", "does not read images"),  # a tool's screenshot too
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     400, "invalid_request_error", "server tools"),
    # The MCP connector and the code-execution container run on Anthropic's side too.
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "extra_body": {"mcp_servers": [{"type": "url", "url": "https://mcp.example.com/sse",
                                      "name": "e"}]}},
     400, "invalid_request_error", "mcp_servers: this server does not connect"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "container": {"skills": [{"type": "anthropic", "skill_id": "xlsx"}]}},
     400, "invalid_request_error", "container: this server runs no"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "text_editor_20250728", "name": "editor"}]},
     400, "invalid_request_error", "named 'str_replace_based_edit_tool'"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "bash_20250124", "name": "bash", "max_characters": 100}]},
     400, "invalid_request_error", "takes no max_characters"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": {}}]},  # unhashable, found by fuzzing: not a 500
     400, "invalid_request_error", "type"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]},
     400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "stop_sequences": [f"stop {i}" for i in range(65)]},
     400, "invalid_request_error", "stop_sequences"),
    # A stop sequence of nothing but whitespace is refused, as an empty one is, in
    # Anthropic's words.
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "stop_sequences": ["end", " \n\t"]},
     400, "invalid_request_error", "stop_sequences: each stop sequence must contain non-whitespace"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "stop_sequences": [""]},
     400, "invalid_request_error", "stop_sequences: each stop sequence must be non-empty"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS},
     400, "invalid_request_error", "not a tool"),
    ({"model": "claude-opus-4", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},
     404, "not_found_error", "claude-opus-4"),
    ({"max_tokens": 4, "messages": [
        {"role": "user", "content": "x"},
        {"role": "system", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     400, "invalid_request_error", "a system message holds text blocks only"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"},
        {"type": "tool_use", "id": "t", "name": "look", "input": {}}]}]},
     400, "invalid_request_error", "tool_use and thinking blocks belong in assistant"),
    ({"max_tokens": 4, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t",
                                           "content": "y"}]},
        {"role": "user", "content": "z"}]},
     400, "invalid_request_error", "tool_result blocks belong in user"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {"type": "forever"}}]}]},
     400, "invalid_request_error", "messages.0.content.0.cache_control.type: Input should be"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"name": "f", "input_schema": {"type": "string"}}]},
     400, "invalid_request_error", "tools.0.input_schema: a tool's parameters"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "tools": [TOOLS[0], TOOLS[0]]},
     400, "invalid_request_error", "tool names must be unique"),
    ({"max_tokens": 4, "messages": [{"role": "assistant", "content": ""}]},
     400, "invalid_request_error", "leaves nothing to reply to"),
    ({"max_tokens": 4, "messages": [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hm", "signature": "s"}]}]},
     400, "invalid_request_error", "leaves nothing to reply to"),
    # Anthropic's bounds on a thinking budget, in its words (its path names the thinking
    # type, which gateways that raise a budget too low for Anthropic match on).
    ({"max_tokens": 4096, "messages": [{"role": "user", "content": "x"}],
      "thinking": {"type": "enabled", "budget_tokens": 1023}},
     400, "invalid_request_error",
     "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024"),
    ({"max_tokens": 1024, "messages": [{"role": "user", "content": "x"}],
      "thinking": {"type": "enabled", "budget_tokens": 1024}},
     400, "invalid_request_error", "`max_tokens` must be greater than `thinking.budget_tokens`"),
    # A prefill (a final assistant message) that ends in whitespace, as a string or as its
    # last text block: Anthropic's 400, in its words.
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"},
                                    {"role": "assistant", "content": "The answer is "}]},
     400, "invalid_request_error",
     "messages: final assistant content cannot end with trailing whitespace"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}, {
        "role": "assistant", "content": [{"type": "text", "text": "{\n"}]}]},
     400, "invalid_request_error",
     "messages: final assistant content cannot end with trailing whitespace"),
])
def test_errors_are_anthropic_error_objects(
    claude: anthropic.Anthropic, model_id: str, body: dict, status: int, kind: str, words: str
) -> None:
    with pytest.raises(anthropic.APIStatusError) as raised:
        claude.messages.create(**{"model": model_id, **body})
    error = raised.value
    assert error.status_code == status
    assert error.body["type"] == "error" and error.body["error"]["type"] == kind
    assert words in error.body["error"]["message"]
    # The body names the request as its header does, as Anthropic's errors do.
    assert error.body["request_id"] == error.response.headers["request-id"]


def test_a_thinking_budget_within_anthropics_bounds_is_taken(
    claude: anthropic.Anthropic, model_id: str
) -> None:
    """A budget below max_tokens, thinking disabled, and (with interleaved thinking, where
    the budget is the whole turn's) a budget over max_tokens are all answered."""
    messages = [{"role": "user", "content": "Hi"}]
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}):
        message = claude.messages.create(model=model_id, max_tokens=1025, messages=messages,
                                         thinking=thinking, stop_sequences=["a", "e", "o"])
        assert message.type == "message"
    interleaved = claude.beta.messages.create(
        model=model_id, max_tokens=2, messages=messages, betas=["interleaved-thinking-2025-05-14"],
        thinking={"type": "enabled", "budget_tokens": 2048})
    assert interleaved.type == "message"


ADAPTIVE = {"type": "adaptive"}


@pytest.mark.parametrize(("thinking", "sampling", "words"), [
    ({"type": "enabled", "budget_tokens": 1024}, {"temperature": 0},
     "`temperature` may only be set to 1 when thinking is enabled or in adaptive mode"),
    (ADAPTIVE, {"temperature": 0.7}, "`temperature` may only be set to 1"),
    (ADAPTIVE, {"top_k": 20}, "`top_k` must be unset when thinking is enabled"),
    (ADAPTIVE, {"top_p": 0.9}, "`top_p` must be between 0.95 and 1 when thinking is enabled"),
])
def test_thinking_takes_only_the_sampling_anthropic_takes_with_it(
    claude: anthropic.Anthropic, model_id: str, thinking: dict, sampling: dict, words: str
) -> None:
    """Thinking on, Anthropic's models sample their own way: a temperature other than 1,
    any top_k and a top_p below 0.95 are its 400s. Within those, or thinking off, any is
    answered."""
    options = {"model": model_id, "max_tokens": 1025, "stop_sequences": ["a", "e", "o"],
               "messages": [{"role": "user", "content": "Hi"}]}
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.messages.create(**options, thinking=thinking, extra_body=sampling)
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    assert words in raised.value.body["error"]["message"]
    for taken in ({"thinking": thinking, "extra_body": {"temperature": 1, "top_p": 0.95}},
                  {"thinking": {"type": "disabled"}, "extra_body": sampling}):
        assert claude.messages.create(**options, **taken).type == "message"


@pytest.mark.parametrize("thinking", [{"type": "enabled", "budget_tokens": 1024}, ADAPTIVE])
def test_thinking_takes_no_forced_tool(
    claude: anthropic.Anthropic, model_id: str, thinking: dict
) -> None:
    """A forced call (tool_choice any or tool) with thinking on is Anthropic's 400; with
    the choice left to the model, the request is answered."""
    options = {"model": model_id, "max_tokens": 1025, "tools": TOOLS, "thinking": thinking,
               "messages": [{"role": "user", "content": "Hi"}]}
    for forced in ({"type": "any"}, {"type": "tool", "name": TOOLS[0]["name"]}):
        with pytest.raises(anthropic.BadRequestError) as raised:
            claude.messages.create(**options, tool_choice=forced)
        assert raised.value.body["error"]["message"] == (
            "Thinking may not be enabled when tool_choice forces tool use.")
    answered = claude.messages.create(**options, tool_choice={"type": "auto"},
                                      stop_sequences=["a", "e", "o"])
    assert answered.type == "message"


@pytest.mark.parametrize("kind", sorted(DEFINED_TOOLS))
def test_anthropic_defined_tools_are_shown_as_their_documented_schema(
    claude: anthropic.Anthropic, model_id: str, kind: str
) -> None:
    """Bash, the text editor and memory come as a type and a name: the model is shown
    the same function a client spelling out Anthropic's schema would give."""
    defined = DEFINED_TOOLS[kind]
    messages = [{"role": "user", "content": "Fix the typo in /repo/README.md."}]
    named = claude.messages.count_tokens(
        model=model_id, messages=messages, tools=[{"type": kind, "name": defined.name}])
    spelled = claude.messages.count_tokens(
        model=model_id, messages=messages,
        tools=[{"name": defined.name, "description": defined.description,
                "input_schema": defined.input_schema}])
    bare = claude.messages.count_tokens(model=model_id, messages=messages)
    assert named.input_tokens == spelled.input_tokens > bare.input_tokens


def test_a_message_thread_is_refused_so_the_sdk_tool_runner_sends_each_turn_whole(
    claude: anthropic.Anthropic, model_id: str
) -> None:
    """The SDK's tool runner threads its turns by default: `thread: {"type": "create"}`,
    then a `continue` carrying the tool results alone, without system and tools, for the
    server to put after the conversation it holds. Nothing is held here: a thread is
    Anthropic's thread_unsupported_request, on which the runner sends each turn whole."""
    ran = []

    @anthropic.beta_tool
    def read_file(path: Literal["README.md"]) -> str:
        """Read a file of the project."""
        ran.append(path)
        return "# radix-mlx"

    runner = claude.beta.messages.tool_runner(
        model=model_id, max_tokens=40, system="You read files.", tools=[read_file],
        tool_choice={"type": "any", "disable_parallel_tool_use": True}, max_iterations=2,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "What does the README say?"}])
    first, second = list(runner)
    assert ran and [block.type for block in first.content] == ["tool_use"]
    # The second turn's prompt is the whole conversation: the first one's, then more.
    first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > first_prompt


@pytest.mark.parametrize("thread", [
    {"type": "create"}, {"type": "continue", "previous_message_id": "msg_0"}])
@pytest.mark.parametrize("stream", [False, True])
def test_a_thread_is_a_400_the_sdks_recognise(server: ServerProcess, model_id: str,
                                               thread: dict, stream: bool) -> None:
    body = {"model": model_id, "max_tokens": 2, "stream": stream, "thread": thread,
            "messages": [{"role": "user", "content": "x"}]}
    response = httpx.post(f"{server.url}/v1/messages", json=body, timeout=60,
                          headers={"x-api-key": API_KEY})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "thread" in error["message"]
    assert error["details"] == {"error_code": "thread_unsupported_request",
                                "unsupported": ["thread"]}
    # No thread is no thread; other errors have no details.
    del body["thread"]
    assert httpx.post(f"{server.url}/v1/messages", json={**body, "thread": None}, timeout=60,
                      headers={"x-api-key": API_KEY}).status_code == 200
    other = httpx.post(f"{server.url}/v1/messages", json={**body, "max_tokens": 0},
                       headers={"x-api-key": API_KEY}).json()["error"]
    assert "details" not in other


def test_models_list_reads_as_anthropics(claude: anthropic.Anthropic, model_id: str) -> None:
    """Claude Code's model discovery (CLAUDE_CODE_ENABLE_GATEWAY_MODEL_DISCOVERY) reads
    /v1/models with this SDK; OpenAI's clients read the same list."""
    models = claude.models.list()
    first = models.data[0]
    assert first.id == model_id and first.type == "model" and first.display_name == model_id
    assert first.created_at.year >= 2024 and first.max_input_tokens > 0
    assert not models.has_more
    assert claude.models.retrieve(model_id).id == model_id
    with pytest.raises(anthropic.NotFoundError) as raised:
        claude.models.retrieve("no-such-model")
    assert raised.value.body["type"] == "error"  # Anthropic's shape, on a path both APIs share
    assert raised.value.body["error"]["type"] == "not_found_error"


def test_authentication_takes_x_api_key_or_bearer(server: ServerProcess, model_id: str) -> None:
    body = {"model": model_id, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    url = f"{server.url}/v1/messages/count_tokens"
    assert httpx.post(url, json=body, headers={"x-api-key": API_KEY}).status_code == 200
    bearer = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.post(url, json=body, headers=bearer).status_code == 200
    # Either header holding the key will do, the other stale (a proxy's, an old login's).
    stale = {"x-api-key": API_KEY, "Authorization": "Bearer stale"}
    assert httpx.post(url, json=body, headers=stale).status_code == 200
    stale = {"x-api-key": "stale", **bearer}
    assert httpx.post(url, json=body, headers=stale).status_code == 200
    refused = httpx.post(url, json=body, headers={"x-api-key": "wrong"})
    assert refused.status_code == 401
    both_wrong = {"x-api-key": "wrong", "Authorization": "Bearer wrong"}
    assert httpx.post(url, json=body, headers=both_wrong).status_code == 401
    assert refused.json()["error"]["type"] == "authentication_error"
    assert refused.json()["request_id"] == refused.headers["request-id"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, auth_token="wrong", max_retries=0) \
            .messages.count_tokens(model=model_id, messages=body["messages"])


def test_too_large_body_is_an_anthropic_413(server: ServerProcess, model_id: str) -> None:
    body = {"model": model_id, "max_tokens": 1,
            "messages": [{"role": "user", "content": "x" * (5 * 2**20)}]}
    response = httpx.post(f"{server.url}/v1/messages", json=body, timeout=60,
                          headers={"x-api-key": API_KEY})
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "request_too_large"


def test_endpoints_in_metrics_and_access_log(
    claude: anthropic.Anthropic, server: ServerProcess, model_id: str
) -> None:
    claude.messages.count_tokens(model=model_id, messages=[{"role": "user", "content": "x"}])
    text = httpx.get(f"{server.url}/metrics", headers={"x-api-key": API_KEY}).text
    assert 'endpoint="/v1/messages/count_tokens",status="200"' in text
    assert "POST /v1/messages 200 prompt=" in server.log()


# -- forced tools and structured output (the grammar's doing: the weights are random) ----


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: Literal["Paris", "Oslo"]
    days: int = Field(ge=1, le=7)
    sunny: bool


WEATHER_TOOL = {"name": "get_weather", "description": "The forecast for a city.",
                "input_schema": Weather.model_json_schema()}
ROOM = 80  # max_tokens: a constrained answer here is far shorter


def test_tool_round_trip_tool_use_then_result_then_answer(
    claude: anthropic.Anthropic, model_id: str
) -> None:
    messages = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    called = claude.messages.create(
        model=model_id, max_tokens=ROOM, tools=[*TOOLS, WEATHER_TOOL], messages=messages,
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    )
    assert called.stop_reason == "tool_use"
    [use] = [block for block in called.content if block.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")  # Anthropic's ids
    Weather.model_validate(use.input)
    messages += [
        {"role": "assistant", "content": [block.model_dump() for block in called.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "Sunny, 24 degrees."}]},
    ]
    answer = claude.messages.create(model=model_id, max_tokens=4, tools=[*TOOLS, WEATHER_TOOL],
                                    messages=messages)
    assert [block.type for block in answer.content] == ["text"]
    assert answer.stop_reason in ("end_turn", "max_tokens")
    # The call and its result are in the answer's prompt.
    def prompt(usage: anthropic.types.Usage) -> int:
        return usage.input_tokens + usage.cache_read_input_tokens

    assert prompt(answer.usage) > prompt(called.usage) + called.usage.output_tokens


# The demo model's template with each call's id rendered, as some models' templates do:
# a follow-up turn's prompt holds the id the client sends back.
ID_TEMPLATE = CHAT_TEMPLATE.replace("""'<tool_call>\\n{"name": "' +""",
                                    """'<tool_call>\\n{"id": "' + call.id + '", "name": "' +""")


@pytest.fixture(scope="module")
def id_template_server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                       ) -> Iterator[ServerProcess]:
    assert ID_TEMPLATE != CHAT_TEMPLATE
    directory = tmp_path_factory.mktemp("call-ids")
    template = directory / "template.jinja"
    template.write_text(ID_TEMPLATE)
    process = start_server(demo_model_dir, directory / "server.log", "--chat-template",
                           str(template))
    yield process
    process.stop()


def test_a_tool_use_id_comes_back_as_the_next_turn_was_prefilled(
    id_template_server: ServerProcess, demo_model_dir: Path, model_id: str
) -> None:
    """A tool_use block's id is Anthropic's (toolu_...) from the moment the call is read:
    where the template renders it, the turn that answers the call finds everything but
    the result cached, the call with its id as the next turn's prefill rendered it."""
    claude = anthropic.Anthropic(base_url=id_template_server.url, api_key="-", max_retries=0)
    options = {"model": model_id, "max_tokens": ROOM, "tools": [WEATHER_TOOL],
               "extra_body": GREEDY}
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    called = claude.messages.create(**options, messages=messages,
                                    tool_choice={"type": "tool", "name": "get_weather"})
    [use] = [block for block in called.content if block.type == "tool_use"]
    assert use.id.startswith("toolu_")
    wait_idle(id_template_server)  # the next turn's prefill is done
    result = "Sunny, 24 degrees."
    messages += [
        {"role": "assistant", "content": [block.model_dump() for block in called.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": result}]},
    ]
    answer = claude.messages.create(**options, messages=messages)
    tokenizer = load_tokenizer(demo_model_dir)
    # Uncached: the result, its turn's end and the reply's opening, not the call.
    assert answer.usage.input_tokens <= len(tokenizer.encode(result)) + 8


def test_any_tool_streams_as_input_json_deltas(claude: anthropic.Anthropic, model_id: str) -> None:
    with claude.messages.stream(
        model=model_id, max_tokens=ROOM, tools=[WEATHER_TOOL],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Weather?"}],
    ) as stream:
        events = list(stream)
        message = stream.get_final_message()
    fragments = [event.delta.partial_json for event in events
                 if event.type == "content_block_delta" and event.delta.type == "input_json_delta"]
    assert len(fragments) > 1
    [use] = [block for block in message.content if block.type == "tool_use"]
    assert json.loads("".join(fragments)) == use.input
    assert [event.content_block.id for event in events
            if event.type == "content_block_start"] == [use.id]
    assert use.id.startswith("toolu_")
    Weather.model_validate(use.input)
    assert message.stop_reason == "tool_use"


def test_a_forced_call_cut_short_has_the_input_its_stream_gives(
    claude: anthropic.Anthropic, model_id: str
) -> None:
    """max_tokens that ends a forced call inside its input: the message's input is what
    was written, read as far as it goes, as the SDK reads the stream's deltas (it used to
    be the text under an `arguments` key)."""
    options = {"model": model_id, "tools": [WEATHER_TOOL],
               "tool_choice": {"type": "tool", "name": "get_weather"},
               "messages": [{"role": "user", "content": "Weather?"}],
               "extra_body": {"temperature": 0}}
    whole = claude.messages.create(max_tokens=ROOM, **options)
    assert whole.stop_reason == "tool_use"
    cut = 0
    for max_tokens in range(1, whole.usage.output_tokens):
        message = claude.messages.create(max_tokens=max_tokens, **options)
        with claude.messages.stream(max_tokens=max_tokens, **options) as stream:
            streamed = stream.get_final_message()
        assert message.stop_reason == streamed.stop_reason == "max_tokens"
        uses = [block.input for block in message.content if block.type == "tool_use"]
        assert uses == [block.input for block in streamed.content if block.type == "tool_use"]
        cut += bool(uses) and "arguments" not in uses[0]
    assert cut > 0


@pytest.mark.parametrize("field", ["output_config", "output_format"])
def test_output_config_json_schema(claude: anthropic.Anthropic, model_id: str,
                                   field: str) -> None:
    """output_format is the structured-outputs beta's name for output_config.format,
    which its clients still send."""
    schema_format = {"type": "json_schema", "schema": Weather.model_json_schema()}
    given = ({"output_config": {"format": schema_format}} if field == "output_config"
             else {"extra_body": {"output_format": schema_format}})
    message = claude.messages.create(
        model=model_id, max_tokens=ROOM, messages=[{"role": "user", "content": "Weather?"}],
        **given)
    Weather.model_validate_json(message.content[0].text)
    assert message.stop_reason == "end_turn"
    if field == "output_format":
        with pytest.raises(anthropic.BadRequestError, match="send one of them"):
            claude.messages.create(
                model=model_id, max_tokens=ROOM, messages=[{"role": "user", "content": "x"}],
                output_config={"format": schema_format}, **given)


def test_thinking_streams_as_a_thinking_block(thinking_server: ServerProcess) -> None:
    """The Qwen3-shaped template opens the thinking block; the random weights never close it,
    so the whole reply is thinking: a thinking block, never text."""
    claude = anthropic.Anthropic(base_url=thinking_server.url, api_key="-", max_retries=0)
    options = {"model": "tiny-thinking", "max_tokens": 5, "extra_body": GREEDY,
               "messages": [{"role": "user", "content": "Which city is the capital?"}]}
    whole = claude.messages.create(**options)
    assert [block.type for block in whole.content] == ["thinking"]
    with claude.messages.stream(**options) as stream:
        deltas = [event.delta for event in stream if event.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert {delta.type for delta in deltas} == {"thinking_delta"}
    assert "".join(delta.thinking for delta in deltas) == whole.content[0].thinking
    assert streamed.content[0].thinking == whole.content[0].thinking


def test_max_tokens_past_the_context_window_is_a_cap(
    claude: anthropic.Anthropic, model_id: str
) -> None:
    """Claude Code asks for 32000 tokens whatever the model: the reply stops where the
    context window ends instead of the request being refused."""
    def count(repeats: int) -> int:
        messages = [{"role": "user", "content": "Go on. " * repeats}]
        return claude.messages.count_tokens(model=model_id, messages=messages).input_tokens

    per_repeat = count(2) - count(1)
    repeats = (MAX_POSITION_EMBEDDINGS - 6 - count(0)) // per_repeat
    prompt = count(repeats)
    with claude.messages.stream(  # the SDK streams any request for this many tokens
        model=model_id, max_tokens=32000, extra_body=GREEDY,
        messages=[{"role": "user", "content": "Go on. " * repeats}],
    ) as stream:
        message = stream.get_final_message()
    assert message.stop_reason == "model_context_window_exceeded"
    assert message.usage.output_tokens == MAX_POSITION_EMBEDDINGS - prompt


def test_a_prompt_past_the_context_window_is_too_long_in_anthropics_words(
    claude: anthropic.Anthropic, model_id: str
) -> None:
    """The real API's 400 for it, "prompt is too long: N tokens > M maximum", which
    Claude Code reads as the cue to compact the conversation; streamed or not."""
    messages = [{"role": "user", "content": "Go on. " * MAX_POSITION_EMBEDDINGS}]
    prompt = claude.messages.count_tokens(model=model_id, messages=messages).input_tokens
    for stream in (False, True):
        with pytest.raises(anthropic.BadRequestError) as raised:
            claude.messages.create(model=model_id, max_tokens=1024, messages=messages,
                                   stream=stream)
        assert raised.value.body["error"] == {
            "type": "invalid_request_error",
            "message": f"prompt is too long: {prompt} tokens > {MAX_POSITION_EMBEDDINGS} maximum"}


def test_a_system_message_mid_conversation_is_served(
    claude: anthropic.Anthropic, model_id: str
) -> None:
    """Claude Code sends system messages between turns (anthropic-beta:
    mid-conversation-system-...): accepted in place, counted in the prompt."""
    turns = [{"role": "user", "content": "Fix the bug."},
             {"role": "assistant", "content": "Which file?"}]
    system = {"role": "system", "content": [{"type": "text", "text": "Plan mode is on."}]}
    later = {"role": "user", "content": "src/app.py"}
    message = claude.beta.messages.create(
        model=model_id, max_tokens=2, messages=[*turns, system, later],
        betas=["mid-conversation-system-2026-01-01"])
    without = claude.messages.count_tokens(model=model_id, messages=[*turns, later])
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens > (
        without.input_tokens)


def test_a_final_assistant_turn_with_tool_use_is_rendered_whole(
    claude: anthropic.Anthropic, client: openai.OpenAI, model_id: str
) -> None:
    """A final assistant message that made a call is no prefill to continue: its text was
    continued, and its tool_use blocks left out of the prompt. It is rendered whole, and
    the reply follows, as a Chat Completions chat ending in that turn is."""
    call = {"path": "README.md"}
    counted = claude.messages.count_tokens(model=model_id, tools=TOOLS, messages=[
        {"role": "user", "content": "What is in README.md?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": call}]}])
    tool = TOOLS[0]
    chat = client.chat.completions.create(model=model_id, max_tokens=1, tools=[
        {"type": "function", "function": {"name": tool["name"], "description": tool["description"],
                                          "parameters": tool["input_schema"]}}], messages=[
        {"role": "user", "content": "What is in README.md?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "read_file", "arguments": json.dumps(call)}}]}])
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_an_empty_assistant_message_alone_is_a_400_when_counted_too(
    claude: anthropic.Anthropic, model_id: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.messages.count_tokens(model=model_id,
                                     messages=[{"role": "assistant", "content": ""}])
    assert "leaves nothing to reply to" in raised.value.body["error"]["message"]


def test_thinking_between_tools_is_thinking_off(thinking_server: ServerProcess) -> None:
    """Anthropic's `between_tools` (thinking off; the model's progress notes between tool
    calls come back as thinking blocks) renders as `disabled` does: the SDK sends it, and
    it was a 400."""
    claude = anthropic.Anthropic(base_url=thinking_server.url, api_key="-", max_retries=0)
    messages = [{"role": "user", "content": "Which city is the capital?"}]
    counted = {kind: claude.messages.count_tokens(model="tiny-thinking", messages=messages,
                                                  thinking={"type": kind}).input_tokens
               for kind in ("between_tools", "disabled", "adaptive")}
    assert counted["between_tools"] == counted["disabled"] != counted["adaptive"]
    message = claude.messages.create(model="tiny-thinking", max_tokens=2, messages=messages,
                                     thinking={"type": "between_tools"})
    assert message.type == "message"


@pytest.fixture(scope="module")
def greedy_thinking_server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                           ) -> Iterator[ServerProcess]:
    """The thinking model, greedy by its own sampling defaults: with thinking on, a request
    may not ask for a temperature other than 1 (Anthropic's rule)."""
    directory = tmp_path_factory.mktemp("greedy-thinking")
    model = build_thinking_model(demo_model_dir, directory / "tiny-thinking")
    models = directory / "models.toml"
    models.write_text(f'[[models]]\nid = "tiny-thinking"\nsource = {json.dumps(str(model))}\n'
                      "sampling.temperature = 0.0\n")
    process = start_server(None, directory / "server.log", "--models-file", str(models))
    yield process
    process.stop()


def test_thinking_displayed_as_omitted_leaves_the_blocks_empty(
        greedy_thinking_server: ServerProcess) -> None:
    """display "omitted" asks for thinking blocks without their text (Anthropic redacts
    it): the blocks come, empty, and a stream sends no thinking_delta; the thinking was
    sent anyway."""
    claude = anthropic.Anthropic(base_url=greedy_thinking_server.url, api_key="-",
                                 max_retries=0)
    options = {"model": "tiny-thinking", "max_tokens": 1025, "stop_sequences": ["a", "e", "o"],
               "messages": [{"role": "user", "content": "Which city is the capital?"}]}
    for thinking in ({"type": "enabled", "budget_tokens": 1024, "display": "omitted"},
                     {"type": "adaptive", "display": "omitted"}):
        whole = claude.messages.create(**options, thinking=thinking)
        assert [(block.type, block.thinking) for block in whole.content] == [("thinking", "")]
        with claude.messages.stream(**options, thinking=thinking) as stream:
            kinds = [event.type for event in stream]
            streamed = stream.get_final_message()
        assert "thinking" not in kinds and streamed.content[0].thinking == ""
        assert [block.type for block in streamed.content] == ["thinking"]
        assert streamed.usage.output_tokens == whole.usage.output_tokens > 0
