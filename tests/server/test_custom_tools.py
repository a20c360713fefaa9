"""OpenAI's custom tools in Chat Completions: a tool whose input is freeform text, shown to
the model as a function of one string and given back as a custom call with that string
as its input, whole or streamed (server/custom_tools.py)."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from server.custom_tools import InputReader, custom_input
from server.events import (
    ChoiceFinished,
    ChoiceResult,
    ToolCall,
    ToolCallArguments,
    ToolCallStarted,
    Usage,
)
from server.openai.adapter import chat_request
from server.openai.formats import ChatFormat
from server.openai.protocol import ChatCompletionRequest
from server.responses.adapter import generation_request
from server.responses.protocol import ResponsesRequest
from tests.server.support import ServerProcess

DIAL = {"type": "custom", "custom": {
    "name": "dial", "description": "Dial a phone number.",
    "format": {"type": "grammar", "grammar": {"syntax": "regex",
                                              "definition": "[0-9]{3}-[0-9]{4}"}}}}
PATCH = {"type": "custom", "custom": {"name": "apply_patch", "description": "Edit files."}}
SHELL = {"type": "function", "function": {"name": "shell", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}}}}
ROOM = 40  # max_tokens: a phone number in its function's arguments is far shorter


def _streamed(arguments: str, cuts: list[int]) -> str:
    """What an `InputReader` gives out of `arguments` arriving cut at `cuts`."""
    reader, out, start = InputReader(), "", 0
    for cut in [*sorted(cuts), len(arguments)]:
        out += reader.feed(arguments[start:cut])
        start = max(start, cut)
    return out + reader.finish()


@given(st.text(), st.booleans(), st.lists(st.integers(0, 400), max_size=12))
def test_an_input_streams_as_it_is_written_and_whole_as_its_call_ends(
        text: str, ascii_only: bool, cuts: list[int]) -> None:
    arguments = json.dumps({"input": text}, ensure_ascii=ascii_only)
    assert custom_input(arguments) == text
    assert _streamed(arguments, cuts) == text
    # Cut off anywhere (max_tokens): what was written of the string, streamed or whole.
    for end in {*cuts, len(arguments) // 2}:
        written = custom_input(arguments[:end])
        assert _streamed(arguments[:end], cuts) == written
        if end > len('{"input": "'):
            assert text.startswith(written.rstrip("\ufffd"))


@pytest.mark.parametrize(("arguments", "given_input"), [
    ('{"patch": "x"}', '{"patch": "x"}'),  # not the function's arguments: as written
    ('{"input": 5}', '{"input": 5}'),
    ('{"inp', '{"inp'),
    ('ls -la', "ls -la"),
    ('{ "input" : "x\\', "x"),  # an escape cut off is not text
    ('{"input": "a\\ud83d\\ude00b"}', "a\U0001F600b"),  # a surrogate pair, whole
    ('{"input": "a\\ud83d', "a\ufffd"),  # half of one: no encoding can send it
    ('{"input": "C:\\path"}', "C:\\path"),  # not a JSON escape: the backslash meant
    ('{"input": "line\nnext"} and more', "line\nnext"),  # a raw newline; nothing after
])
def test_an_input_is_what_the_model_wrote_of_its_one_string(arguments, given_input) -> None:
    assert custom_input(arguments) == given_input
    assert _streamed(arguments, list(range(len(arguments)))) == given_input


def test_a_streamed_custom_call_adds_up_to_the_whole_responses_call() -> None:
    patch = '*** Begin Patch\n*** Add File: a.txt\n+"hi" \u00e9\n*** End Patch'
    arguments = json.dumps({"input": patch})
    events = [ToolCallStarted(0, 0, "call_a", "apply_patch"),
              *(ToolCallArguments(0, 0, arguments[at:at + 3])
                for at in range(0, len(arguments), 3)),
              ToolCallStarted(0, 1, "call_b", "shell"),
              ToolCallArguments(0, 1, '{"command": "ls"}'),
              ChoiceFinished(0, "tool_calls", Usage(prompt_tokens=9, completion_tokens=40))]
    fmt = ChatFormat("chatcmpl-1", "m", logprobs=False, custom_tools=frozenset({"apply_patch"}))
    calls: dict[int, dict] = {}
    for event in events:
        chunk = fmt.chunk(event)
        for delta in (chunk and chunk.choices[0].delta.tool_calls) or ():
            call = calls.setdefault(delta.index, {"id": delta.id, "type": delta.type})
            if delta.custom is not None:
                call.setdefault("custom", {"name": delta.custom.name, "input": ""})
                call["custom"]["input"] += delta.custom.input
            if delta.function is not None:
                call.setdefault("function", {"name": delta.function.name, "arguments": ""})
                call["function"]["arguments"] += delta.function.arguments
    whole = fmt.response([ChoiceResult(tool_calls=[
        ToolCall("call_a", "apply_patch", arguments), ToolCall("call_b", "shell",
                                                               '{"command": "ls"}')],
        finish_reason="tool_calls")], Usage()).model_dump()
    assert list(calls.values()) == whole["choices"][0]["message"]["tool_calls"] == [
        {"id": "call_a", "type": "custom", "custom": {"name": "apply_patch", "input": patch}},
        {"id": "call_b", "type": "function",
         "function": {"name": "shell", "arguments": '{"command": "ls"}'}}]


def test_a_custom_call_sent_back_is_rendered_as_its_function_was_called() -> None:
    body = ChatCompletionRequest.model_validate({"model": "m", "tools": [PATCH], "messages": [
        {"role": "user", "content": "Add a.txt."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "custom",
             "custom": {"name": "apply_patch", "input": "*** Add File: a.txt"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Done."}]})
    request = chat_request(body)
    [tool] = request.tools
    assert (tool.name, list(tool.parameters["properties"])) == ("apply_patch", ["input"])
    assert request.messages[1]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "apply_patch", "arguments": {"input": "*** Add File: a.txt"}}}]


def test_a_forced_custom_tool_writes_its_grammar_streamed_or_not(
        client: openai.OpenAI, model_id: str) -> None:
    """Random weights dial a phone number only because the grammar makes them."""
    ask = {"model": model_id, "messages": [{"role": "user", "content": "Call home."}],
           "tools": [DIAL, SHELL], "tool_choice": {"type": "custom", "custom": {"name": "dial"}},
           "parallel_tool_calls": False, "max_tokens": ROOM, "temperature": 0.0}
    reply = client.chat.completions.create(**ask)
    [call] = reply.choices[0].message.tool_calls
    assert (call.type, call.custom.name) == ("custom", "dial")
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", call.custom.input)
    assert reply.choices[0].finish_reason == "tool_calls"
    deltas = [delta.model_dump(exclude_none=True)
              for chunk in client.chat.completions.create(**ask, stream=True)
              for delta in (chunk.choices and chunk.choices[0].delta.tool_calls) or ()]
    assert deltas[0]["type"] == "custom" and deltas[0]["custom"] == {"name": "dial", "input": ""}
    assert "".join(delta["custom"]["input"] for delta in deltas) == call.custom.input
    # The call and its result sent back continue the conversation from the cache.
    answer = client.chat.completions.create(
        model=model_id, tools=[DIAL, SHELL], max_tokens=3, messages=[
            *ask["messages"], reply.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "Nobody answered."}])
    assert answer.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens


@pytest.mark.parametrize(("fields", "message"), [
    ({"tools": [PATCH], "tool_choice": {"type": "function", "function": {"name": "apply_patch"}}},
     "names function 'apply_patch', which is not in tools"),
    ({"tools": [SHELL], "tool_choice": {"type": "custom", "custom": {"name": "shell"}}},
     "names custom tool 'shell', which is not in tools"),
    ({"tools": [PATCH, {"type": "function", "function": {"name": "apply_patch"}}]},
     "'apply_patch' given more than once"),
    ({"tools": [{"type": "custom", "custom": {"name": "x", "format": {"type": "grammar"}}}]},
     "a grammar format needs its grammar"),
    ({"tools": [{"type": "custom", "custom": {"name": "x", "format": {
        "type": "grammar", "grammar": {"syntax": "ebnf", "definition": "a"}}}}]},
     "'lark' or 'regex'"),
    ({"tools": [{"type": "web_search"}]}, "expected tags: 'function', 'custom'"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "custom", "custom": {"name": "x"}}]}]}, "custom.input: Field required"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "mcp"}]}]}, "must be a function or custom tool call"),
    ({"tools": [{**DIAL, "custom": {**DIAL["custom"], "format": {"type": "grammar", "grammar": {
        "syntax": "regex", "definition": "(?=a)b"}}}}],
      "tool_choice": {"type": "custom", "custom": {"name": "dial"}}}, "look-around"),
])
def test_custom_tools_a_request_cannot_have_are_a_400(
        server: ServerProcess, model_id: str, headers: dict[str, str], fields: dict,
        message: str) -> None:
    body = {"model": model_id, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, **fields}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body,
                          headers=headers, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("chat_format", "responses_format", "shown"), [
    (None, None, "The tool's input, as free text."),
    ({"type": "text"}, {"type": "text"}, "The tool's input, as free text."),
    ({"type": "grammar", "grammar": {"syntax": "lark", "definition": "start: WORD"}},
     {"type": "grammar", "syntax": "lark", "definition": "start: WORD"},
     "The tool's input: text in this lark grammar:\nstart: WORD"),
])
def test_both_apis_show_a_custom_tool_as_the_same_function(
        chat_format: dict | None, responses_format: dict | None, shown: str) -> None:
    """A `text` format is free text, as no format is (it was a 500 on the Responses API)."""
    chat_tool = {"type": "custom", "custom": {"name": "note", "format": chat_format}}
    responses_tool = {"type": "custom", "name": "note", "format": responses_format}
    [from_chat] = chat_request(ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}],
         "tools": [chat_tool]})).tools
    [from_responses] = generation_request(ResponsesRequest.model_validate(
        {"model": "m", "input": "hi", "tools": [responses_tool]}), []).tools
    assert from_chat == from_responses
    assert from_chat.parameters["properties"]["input"] == {"type": "string",
                                                           "description": shown}
