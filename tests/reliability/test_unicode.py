"""Arbitrary Unicode in every string of every endpoint's body: lone surrogates (valid JSON
escapes that are not valid Unicode), non-characters, control characters and combining
marks. Whatever a JSON decoder, chat template or tokenizer refuses is a 400 in the API's
own error shape; nothing is a 5xx, and the server goes on serving with nothing pinned."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.support import AUTH, launch, stop
from tests.server.support import ServerProcess, wait_idle

EXAMPLES = 40  # per endpoint; derandomized, so a failure reproduces

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                             "description": "The city."}},
                   "required": ["city"]}}}
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "messages": [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."},
            {"role": "user", "content": "And in Lyon?", "name": "alice"},
        ],
        "tools": [TOOL], "stop": ["\n\n"], "max_tokens": 2, "user": "u-1",
    },
    "/v1/completions": {"prompt": ["Once upon a time", "The end"], "max_tokens": 2,
                        "stop": "zz", "suffix": ""},
    "/v1/responses": {
        "instructions": "You answer briefly.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny."},
            {"role": "user", "content": "And in Lyon?"},
        ],
        "tools": [{"type": "function", **TOOL["function"]}], "max_output_tokens": 16,
        "text": {"format": {"type": "text"}}, "store": False,
    },
    "/v1/messages": {
        "model": "tiny-seed0",  # the demo model's id; Anthropic's API requires one
        "system": [{"type": "text", "text": "You answer briefly."}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                               "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": "Sunny."},
                                         {"type": "text", "text": "And in Lyon?"}]},
        ],
        "tools": [{"name": "get_weather", "description": "Weather of a city.",
                   "input_schema": TOOL["function"]["parameters"]}],
        "stop_sequences": ["\n\nHuman:"], "max_tokens": 2,
    },
}
BODIES["/v1/messages/count_tokens"] = {
    key: value for key, value in BODIES["/v1/messages"].items()
    if key not in ("max_tokens", "stop_sequences")}

# Strings a client can send that Unicode-unaware code gets wrong.
HOSTILE = st.text(
    alphabet=st.one_of(
        st.integers(0xD800, 0xDFFF).map(chr),  # lone surrogates: \ud800-\udfff escapes
        st.sampled_from("\ufffe\uffff\ufdd0\U0001fffe\U0010ffff"),  # non-characters
        st.characters(categories=["Cc"]),  # control characters, NUL included
        st.characters(categories=["Mn"]),  # combining marks
        st.characters(),
    ),
    min_size=1,
    max_size=12,
)


def string_paths(value: Any, path: tuple = ()) -> Iterator[tuple]:
    """Where `value` holds a string: every string value, and every key of a mapping (a
    schema's property names, tool arguments)."""
    if isinstance(value, str):
        yield path
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from string_paths(item, (*path, index))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield (*path, ("key", key))
            yield from string_paths(item, (*path, key))


def replaced(body: dict[str, Any], path: tuple, text: str) -> dict[str, Any]:
    body = copy.deepcopy(body)
    *parents, last = path
    target = body
    for step in parents:
        target = target[step]
    if isinstance(last, tuple):  # a key: rename it, keeping its value
        target[text] = target.pop(last[1])
    else:
        target[last] = text
    return body


@pytest.fixture(scope="module")
def server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    process = launch(demo_model_dir, tmp_path_factory.mktemp("unicode") / "server.log")
    yield process
    stop(process)


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    # ensure_ascii writes a lone surrogate as its \udXXX escape: valid JSON, invalid Unicode.
    data = json.dumps(body, ensure_ascii=True).encode()
    return httpx.post(f"{server.url}{path}", content=data, timeout=60,
                      headers={**AUTH, "content-type": "application/json"})


def assert_clean(path: str, response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code == 200:
        return
    body = response.json()
    if path.startswith("/v1/messages"):  # Anthropic's error shape
        assert body["type"] == "error" and body["error"]["message"], body
    else:
        assert body["error"]["message"] and body["error"]["type"], body


@pytest.mark.parametrize("path", list(BODIES))
def test_every_string_field_takes_any_unicode(server: ServerProcess, path: str) -> None:
    body = BODIES[path]
    assert post(server, path, body).status_code == 200  # the body itself is fine
    paths = list(string_paths(body))

    @given(where=st.sampled_from(paths), text=HOSTILE)
    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def check(where: tuple, text: str) -> None:
        assert_clean(path, post(server, path, replaced(body, where, text)))

    check()
    metrics = wait_idle(server)
    assert metrics["radix_mlx_tree_pinned_bytes"] == 0
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


# Found before this test existed, kept as plain examples: each was a 500.
FOUND = {
    "a lone surrogate in a message": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi \ud800 there"}], "max_tokens": 1}),
    "a lone surrogate inside tool-call arguments (JSON in JSON)": (
        "/v1/chat/completions",
        {"messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
                "name": "f", "arguments": '{"a": "\\ud800"}'}}]},
            {"role": "tool", "tool_call_id": "c", "content": "ok"}],
         "tools": [TOOL], "max_tokens": 1}),
}


@pytest.mark.parametrize(("path", "body"), FOUND.values(), ids=FOUND.keys())
def test_what_was_a_500(server: ServerProcess, path: str, body: dict[str, Any]) -> None:
    response = post(server, path, body)
    assert response.status_code in (200, 400), response.text
    assert_clean(path, response)
