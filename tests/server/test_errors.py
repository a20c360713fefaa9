"""Bad input gets OpenAI's error object with the right status, and harms nobody: the
server answers a normal request right after every case."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.loader import load_tokenizer
from server.http.errors import APIError, ServerBusy
from tests.server.support import API_KEY, ServerProcess

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
HELLO = [{"role": "user", "content": "Hello"}]
FUNCTIONS = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
BIG = 4 * 1024 * 1024 + 1  # one byte over the default max_body_bytes
ONE_PIXEL_PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGNgYGAAAAAEAAH2FzhVAAAAAElFTkSuQmCC"


def chat(**fields: Any) -> dict:
    return {"json": {"messages": HELLO, "max_tokens": 2, **fields}}


def completion(**fields: Any) -> dict:
    return {"json": {"prompt": "Hello", "max_tokens": 2, **fields}}


def _chunks() -> Iterator[bytes]:
    # A generator body makes httpx send it chunked, with no Content-Length to check.
    for _ in range(BIG // 65536 + 1):
        yield b" " * 65536


# (case, method, path, request options, status, error code, error param)
CASES = [
    ("bad json", "POST", CHAT, {"content": b'{"messages": ['}, 400, "invalid_request", None),
    ("body not an object", "POST", CHAT, {"json": [1, 2]}, 400, "invalid_request", None),
    ("wrong type", "POST", CHAT, chat(n="2"), 400, "invalid_request", "n"),
    ("bool for int", "POST", CHAT, chat(max_tokens=True), 400, "invalid_request", "max_tokens"),
    ("temperature > 2", "POST", CHAT, chat(temperature=2.5), 400, "invalid_request",
     "temperature"),
    ("top_p > 1", "POST", CHAT, chat(top_p=1.5), 400, "invalid_request", "top_p"),
    ("penalty < -2", "POST", CHAT, chat(presence_penalty=-3), 400, "invalid_request",
     "presence_penalty"),
    ("top_logprobs > 20", "POST", CHAT, chat(logprobs=True, top_logprobs=21), 400,
     "invalid_request", "top_logprobs"),
    ("top_logprobs without logprobs", "POST", CHAT, chat(top_logprobs=2), 400,
     "invalid_request", "top_logprobs"),
    ("logit_bias > 100", "POST", CHAT, chat(logit_bias={"5": 101}), 400, "invalid_request",
     "logit_bias"),
    ("logit_bias key", "POST", CHAT, chat(logit_bias={"a": 1}), 400, "invalid_request",
     "logit_bias"),
    ("logit_bias key in Arabic-Indic digits", "POST", CHAT, chat(logit_bias={"\u0667": 1}),
     400, "invalid_request", "logit_bias"),
    ("logit_bias key with a leading zero", "POST", CHAT, chat(logit_bias={"7": 1, "007": -1}),
     400, "invalid_request", "logit_bias"),
    ("logit_bias token out of vocab", "POST", CHAT, chat(logit_bias={"999999": 1}), 400,
     "invalid_request", "logit_bias"),
    ("65 stop strings", "POST", CHAT, chat(stop=[f"s{i}" for i in range(65)]), 400,
     "array_above_max_length", "stop"),
    ("n = 0", "POST", CHAT, chat(n=0), 400, "invalid_request", "n"),
    ("max_tokens = 0", "POST", CHAT, chat(max_tokens=0), 400, "invalid_request", "max_tokens"),
    # OpenAI's least max_output_tokens.
    ("max_output_tokens = 15", "POST", RESPONSES,
     {"json": {"input": "Hello", "max_output_tokens": 15}}, 400, "integer_below_min_value",
     "max_output_tokens"),
    # OpenAI's bounds on metadata, in both of its APIs: 16 pairs, keys of 64 characters,
    # values of 512, strings only.
    *[(f"metadata: {what}", "POST", path, {"json": {**body, "metadata": metadata}}, 400, code,
       "metadata")
      for path, body in ((RESPONSES, {"input": "Hello", "max_output_tokens": 16}),
                         (CHAT, chat()["json"]))
      for what, metadata, code in (
          ("17 pairs", {f"k{i}": "v" for i in range(17)}, "object_above_max_properties"),
          ("a key of 65", {"k" * 65: "v"}, "string_above_max_length"),
          ("a value of 513", {"k": "v" * 513}, "string_above_max_length"),
          ("a number", {"k": 1}, "invalid_request"))],
    ("empty messages", "POST", CHAT, {"json": {"messages": []}}, 400, "invalid_request",
     "messages"),
    ("missing messages", "POST", CHAT, {"json": {"model": "x"}}, 400, "invalid_request",
     "messages"),
    ("empty object", "POST", COMPLETIONS, {"json": {}}, 400, "invalid_request", "prompt"),
    ("field named as a request part", "POST", "/v1/rerank", {"json": {}}, 400,
     "invalid_request", "query"),
    ("unknown role", "POST", CHAT, chat(messages=[{"role": "robot", "content": "x"}]), 400,
     "invalid_request", "messages"),
    ("image content", "POST", CHAT,
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     400, "invalid_request", "messages"),
    ("image to a text model", "POST", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{ONE_PIXEL_PNG}"}}]}]),
     400, "invalid_image", "messages"),
    ("image in classify chats", "POST", "/v1/classify", {"json": {"messages": [[
        {"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": f"data:image/png;base64,{ONE_PIXEL_PNG}"}}]}]]}},
     400, "invalid_image", "messages"),
    ("unknown response_format", "POST", CHAT, chat(response_format={"type": "yaml"}), 400,
     "invalid_request", "response_format"),
    ("json_schema without a name", "POST", CHAT,
     chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}}), 400,
     "invalid_request", "response_format"),
    ("unenforceable schema", "POST", CHAT, chat(response_format={
        "type": "json_schema",
        "json_schema": {"name": "s", "strict": True, "schema": {"type": "array",
                                                                "uniqueItems": True}},
    }), 400, "unsupported_schema", "response_format"),
    ("integer the grammar engine dies on", "POST", CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "s", "schema": {
            "type": "integer", "minimum": -1e19, "maximum": -1e19}},
    }), 400, "unsupported_schema", "response_format"),
    # llguidance recurses once a reference compiling it: checked on a smaller stack than
    # the server's (engine/grammar_check.py), it ends the checker's process, not the server.
    ("references nested past the grammar engine's stack", "POST", CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "s", "schema": {
            "$ref": "#/$defs/d0", "$defs": {
                **{f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(3000)},
                "d3000": {"type": "integer"}}}},
    }), 400, "unsupported_schema", "response_format"),
    ("unenforceable tool parameters", "POST", CHAT, chat(
        tools=[{"type": "function", "function": {
            "name": "f", "strict": True,
            "parameters": {"type": "object", "not": {"required": ["a"]}}}}],
        tool_choice="required",
    ), 400, "unsupported_schema", "tools"),
    ("tool parameters not an object's", "POST", CHAT, chat(
        tools=[{"type": "function", "function": {"name": "f",
                                                 "parameters": {"type": "string"}}}],
    ), 400, "invalid_request", "tools"),
    ("two tools of one name", "POST", CHAT, chat(
        tools=[{"type": "function", "function": {"name": "f"}}] * 2,
    ), 400, "invalid_request", "tools"),
    ("tool_choice naming no tool", "POST", CHAT, chat(
        tools=[{"type": "function", "function": {"name": "f"}}],
        tool_choice={"type": "function", "function": {"name": "g"}},
    ), 400, "invalid_request", "tool_choice"),
    ("tool_choice without tools", "POST", CHAT, chat(tool_choice="required"), 400,
     "invalid_request", "tool_choice"),
    ("a response's tool_choice naming no tool", "POST", RESPONSES, {"json": {
        "input": "Hello", "max_output_tokens": 16, "tools": [{"type": "function", "name": "f"}],
        "tool_choice": {"type": "function", "name": "g"}}}, 400, "invalid_request",
     "tool_choice"),
    ("a response format's name with a space", "POST", RESPONSES, {"json": {
        "input": "x", "text": {"format": {"type": "json_schema", "name": "my schema",
                                          "schema": {"type": "object"}}}}}, 400,
     "invalid_request", "text"),
    ("a response's two tools of one name", "POST", RESPONSES, {"json": {
        "input": "Hello", "max_output_tokens": 16,
        "tools": [{"type": "function", "name": "f"}] * 2}}, 400, "invalid_request", "tools"),
    ("deprecated functions", "POST", CHAT, chat(functions=[{"name": "f", "parameters": {}}]),
     400, "invalid_request", "functions"),
    ("deprecated function_call", "POST", CHAT, chat(function_call={"name": "f"}),
     400, "invalid_request", "function_call"),
    ("audio out", "POST", CHAT, chat(modalities=["text", "audio"]), 400, "invalid_request",
     "modalities"),
    ("legacy unenforceable schema", "POST", COMPLETIONS, completion(response_format={
        "type": "json_schema",
        "json_schema": {"name": "s", "strict": True, "schema": {"type": "string",
                                                                "format": "ipv9"}},
    }), 400, "unsupported_schema", "response_format"),
    ("a streamed schema forcing an endless value", "POST", CHAT, chat(
        stream=True, response_format={"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"$ref": "#/$defs/a", "$defs": {"a": {
                "type": "object", "properties": {"n": {"$ref": "#/$defs/a"}},
                "required": ["n"]}}}}}), 400, "unsupported_schema", "response_format"),
    # A Responses tool's `strict` unsaid: its schema is normalized to strict mode first.
    ("a required entry that names nothing", "POST", "/v1/responses", {"json": {
        "input": "Hello", "max_output_tokens": 16, "tools": [{
            "type": "function", "name": "f", "parameters": {
                "type": "object", "properties": {"a": {}}, "required": [{}]}}]}},
     400, "unsupported_schema", "tools"),
    ("stream_options without stream", "POST", CHAT,
     chat(stream_options={"include_usage": True}), 400, "invalid_request", "stream_options"),
    ("context length", "POST", CHAT, chat(max_tokens=10**6), 400, "context_length_exceeded",
     "messages"),
    ("completion context length", "POST", COMPLETIONS, completion(max_tokens=10**6), 400,
     "context_length_exceeded", "prompt"),
    ("prompt of wrong shape", "POST", COMPLETIONS, completion(prompt={"a": 1}), 400,
     "invalid_request", "prompt"),
    ("negative token id", "POST", COMPLETIONS, completion(prompt=[1, -2]), 400,
     "invalid_request", "prompt"),
    ("token id out of vocab", "POST", COMPLETIONS, completion(prompt=[1, 10**6]), 400,
     "invalid_request", "prompt"),
    ("nothing to return", "POST", COMPLETIONS, completion(max_tokens=0), 400,
     "invalid_request", "echo"),
    # Two output formats, one of them another server's grammar field.
    ("vLLM's guided_choice beside response_format", "POST", COMPLETIONS,
     completion(response_format={"type": "json_object"}, guided_choice=["yes", "no"]), 400,
     "invalid_request", "guided_choice"),
    ("suffix", "POST", COMPLETIONS, completion(suffix="x"), 400, "invalid_request", "suffix"),
    ("best_of", "POST", COMPLETIONS, completion(best_of=3), 400, "invalid_request", "best_of"),
    ("embeddings input a number", "POST", "/v1/embeddings", {"json": {"input": 5}}, 400,
     "invalid_request", "input"),
    ("embeddings input null", "POST", "/v1/embeddings", {"json": {"input": None}}, 400,
     "invalid_request", "input"),
    ("embeddings input a bool", "POST", "/v1/embeddings", {"json": {"input": True}}, 400,
     "invalid_request", "input"),
    # A field by two of its names: which one wins would be a guess.
    ("rerank documents and texts", "POST", "/v1/rerank",
     {"json": {"query": "cat", "documents": ["a"], "texts": ["b"]}}, 400, "invalid_request",
     None),
    ("score text_1 and queries", "POST", "/v1/score",
     {"json": {"text_1": "a", "queries": "b", "text_2": "c"}}, 400, "invalid_request", None),
    ("unknown model", "POST", CHAT, chat(model="gpt-4o"), 404, "model_not_found", "model"),
    ("unknown model card", "GET", "/v1/models/gpt-4o", {}, 404, "model_not_found", "model"),
    ("unknown route", "GET", "/v1/engines", {}, 404, "not_found", None),
    # Not Starlette's redirect, whose Location would come from the Host header.
    ("trailing slash", "POST", CHAT + "/", {**chat(), "headers": {
        "Authorization": f"Bearer {API_KEY}", "Host": "elsewhere.localhost"}}, 404,
     "not_found", None),
    ("wrong method", "GET", CHAT, {}, 405, "method_not_allowed", None),
    ("body too large", "POST", CHAT, {"content": b" " * BIG}, 413, "request_too_large", None),
    ("chunked body too large", "POST", CHAT, {"content": _chunks()}, 413, "request_too_large",
     None),
    # OpenAI's limit, refused as the body is read: 10,000 tools took seconds to render
    # and tokenize, every other stream stalled meanwhile, before a too-long refusal.
    ("129 tools", "POST", CHAT, chat(tools=FUNCTIONS), 400, "array_above_max_length",
     "tools"),
    ("129 tools in a response", "POST", RESPONSES,
     {"json": {"input": "Hello", "max_output_tokens": 16, "tools": [
        {"type": "function", **tool["function"]} for tool in FUNCTIONS]}},
     400, "array_above_max_length", "tools"),
    ("missing key", "POST", CHAT, {**chat(), "headers": {}}, 401, "invalid_api_key", None),
    ("wrong key", "POST", CHAT, {**chat(), "headers": {"Authorization": "Bearer nope"}}, 401,
     "invalid_api_key", None),
    ("not bearer", "GET", "/v1/models", {"headers": {"Authorization": API_KEY}}, 401,
     "invalid_api_key", None),
]


@pytest.mark.parametrize(
    ("method", "path", "options", "status", "code", "param"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_bad_request(
    server: ServerProcess, headers: dict[str, str], method: str, path: str, options: dict,
    status: int, code: str, param: str | None,
) -> None:
    options = {"headers": headers, **options}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        response = http.request(method, path, **options)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["code"], error["param"]) == (code, param), error
        assert error["message"] and "Traceback" not in response.text
        assert API_KEY not in response.text
        if status == 401:
            assert response.headers["www-authenticate"] == "Bearer"
        # The server is unharmed.
        ok = http.post(COMPLETIONS, headers=headers, json={"prompt": "Hi", "max_tokens": 1})
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(("path", "allowed"), [
    (CHAT, "POST"), ("/v1/messages", "POST"), ("/v1/responses/resp_x", "DELETE, GET, HEAD"),
    ("/admin/cache", "DELETE, GET, HEAD"), ("/v1/models", "GET, HEAD"),
])
def test_a_wrong_method_is_told_every_method_its_path_takes(
    server: ServerProcess, headers: dict[str, str], path: str, allowed: str
) -> None:
    """RFC 9110: a 405 lists what the path takes, every route of it (a stored response is
    read and deleted), whatever the other APIs' error shapes."""
    response = httpx.put(f"{server.url}{path}", headers=headers, timeout=30)
    assert response.status_code == 405
    assert response.headers["allow"] == allowed


def test_head_answers_as_get_does_without_the_body(
    server: ServerProcess, headers: dict[str, str]
) -> None:
    """`curl -I` and HTTP monitors send HEAD: GET's status and headers, no body, on every
    path that answers GET, keyed like GET; a path without GET says what it takes."""
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path in ("/v1/models", "/health", "/"):
            got, head = http.get(path, headers=headers), http.head(path, headers=headers)
            assert (head.status_code, head.content) == (got.status_code, b"")
            assert head.headers["content-type"] == got.headers["content-type"]
            assert head.headers["content-length"] == got.headers["content-length"]
        assert http.head("/v1/models").status_code == 401
        assert http.head("/v1/models/nope", headers=headers).status_code == 404
        refused = http.head(CHAT, headers=headers)
        assert (refused.status_code, refused.headers["allow"]) == (405, "POST")


def test_an_unknown_model_name_is_quoted_short(
    server: ServerProcess, headers: dict[str, str]
) -> None:
    """The 404 names the model asked for, its first 200 characters: a name of 20,000
    would make the error that size (every API's client shows the message)."""
    name = "m" * 20_000
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
        responses = [http.post(CHAT, **chat(model=name)), http.get(f"/v1/models/{name}")]
    for response in responses:
        assert response.status_code == 404
        message = response.json()["error"]["message"]
        assert f"'{'m' * 200}...' does not exist" in message and len(message) < 400


def test_a_prompt_far_past_the_window_is_too_long_before_it_is_encoded(
    server: ServerProcess, headers: dict[str, str], demo_model_dir: Path, model_id: str
) -> None:
    """A text longer than the window's tokens could hold at the tokenizer's longest token
    is refused by its length: 4 MB of prompt took 16 s of a busy core to encode, only to
    be told it did not fit. Each API says so in its own words, with the bound it knows."""
    window = httpx.post(f"{server.url}/tokenize", headers=headers, timeout=30,
                        json={"prompt": "Hi"}).json()["max_model_len"]
    longest = load_tokenizer(demo_model_dir).most_chars_a_token
    text = "🦜 parrot " * (window * longest // 9 + 1)
    least = len(text) // longest  # the bare text's: a chat's template adds to it
    for path, body, param in (
            (CHAT, {"messages": [{"role": "user", "content": text}]}, "messages"),
            (COMPLETIONS, {"prompt": text}, "prompt")):
        response = httpx.post(f"{server.url}{path}", headers=headers, timeout=60,
                              json={**body, "max_tokens": 2})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", param)
        said = re.search(r"your prompt has at least (\d+) \(about (\d+)\) tokens",
                         error["message"])
        assert said and int(said[1]) >= least, error
        assert path == CHAT or int(said[1]) == least
    # Anthropic's words give one count, which Claude Code compacts by: the estimate's,
    # where the bound is tenfold short.
    chat = {"model": model_id, "messages": [{"role": "user", "content": text}]}
    counted = httpx.post(f"{server.url}/v1/messages/count_tokens", headers=headers,
                         timeout=120, json=chat).json()["input_tokens"]
    response = httpx.post(f"{server.url}/v1/messages", headers=headers, timeout=60,
                          json={**chat, "max_tokens": 2})
    assert response.status_code == 400
    said = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum",
                        response.json()["error"]["message"])
    assert said and int(said[2]) == window, response.text
    assert abs(int(said[1]) - counted) < counted / 20, (said[1], counted)


def test_a_prompt_scored_alone_may_fill_the_window_with_the_longest_tokens(
    server: ServerProcess, headers: dict[str, str], demo_model_dir: Path
) -> None:
    """echo with max_tokens 0 scores a prompt and generates nothing: one of the window's
    full length is served. Made of the tokenizer's longest tokens, its length alone says
    it might not fit; it was refused as leaving no room for a reply."""
    tokenizer = load_tokenizer(demo_model_dir)
    window = httpx.post(f"{server.url}/tokenize", headers=headers, timeout=30,
                        json={"prompt": "Hi"}).json()["max_model_len"]
    longest = max(tokenizer.vocabulary().values(), key=lambda i: len(tokenizer.decode([i])))
    text = tokenizer.decode([longest] * window)
    assert len(tokenizer.encode(text, special_tokens=False)) == window
    scored = httpx.post(f"{server.url}{COMPLETIONS}", headers=headers, timeout=300, json={
        "prompt": text, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert scored.status_code == 200, scored.text
    assert len(scored.json()["choices"][0]["logprobs"]["tokens"]) == window
    fuller = httpx.post(f"{server.url}{COMPLETIONS}", headers=headers, timeout=60, json={
        "prompt": text, "max_tokens": 1})
    assert fuller.status_code == 400


def test_an_assistant_message_of_nothing_is_refused_in_the_apis_words(
    server: ServerProcess, headers: dict[str, str]
) -> None:
    """Content may be null only beside tool calls, as OpenAI has it; the chat template
    used to refuse it in its own words ("'dict object' has no attribute 'content'")."""
    messages = [*HELLO, {"role": "assistant", "content": None}, *HELLO]
    response = httpx.post(f"{server.url}{CHAT}", headers=headers, timeout=30,
                          json={"messages": messages, "max_tokens": 2})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages"
    assert "needs content, a refusal or tool_calls" in error["message"]


@pytest.mark.parametrize(("path", "body", "required"), [
    (CHAT, {**chat()["json"], "n": None, "stream": None, "logprobs": None,
            "presence_penalty": None, "frequency_penalty": None, "tools": None,
            "tool_choice": None}, "messages"),
    (COMPLETIONS, {**completion()["json"], "n": None, "stream": None, "echo": None,
                   "presence_penalty": None, "frequency_penalty": None}, "prompt"),
    ("/v1/responses", {"input": "Hello", "max_output_tokens": 16, "stream": None,
                       "store": None, "background": None}, "input"),
    ("/v1/messages", {"messages": HELLO, "max_tokens": 2, "stream": None}, "messages"),
], ids=["chat", "completions", "responses", "messages"])
def test_null_for_an_optional_field_is_its_default(
    server: ServerProcess, headers: dict[str, str], model_id: str, path: str, body: dict,
    required: str,
) -> None:
    """OpenAI's optional parameters are nullable: the OpenAI SDK sends null for one given
    as None, and frameworks forward every option they hold. Each took a 400 ("n: Input
    should be a valid integer") where null is the default; a required field still may not
    be null."""
    body = {"model": model_id, **body}  # Anthropic's Messages API requires it
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
        answer = http.post(path, json=body)
        assert answer.status_code == 200, answer.text
        assert "text/event-stream" not in answer.headers["content-type"]  # stream's default
        refused = http.post(path, json={**body, required: None})
    assert refused.status_code == 400, refused.text


def test_only_root_and_health_are_open_without_the_key(server: ServerProcess) -> None:
    """Load balancers probe /health with no secret, clients probe /; /metrics says what is
    cached and how busy the server is, so it needs the key like the API."""
    assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ready"
    assert httpx.head(f"{server.url}/", timeout=10).status_code == 200
    assert httpx.head(f"{server.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 401
    # A POST to the base URL is TEI's embed, an API call like any other.
    refused = httpx.post(f"{server.url}/", json={"inputs": "hello"}, timeout=10)
    assert refused.status_code == 401 and refused.json()["error_type"] == "Validation"
    # Cohere's embed refuses in Cohere's shape, which its SDK hands its caller.
    refused = httpx.post(f"{server.url}/v2/embed", json={"texts": ["hello"]}, timeout=10)
    assert refused.status_code == 401 and "API key" in refused.json()["message"]
    keyed = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(f"{server.url}/metrics", headers=keyed, timeout=10).status_code == 200


@pytest.mark.parametrize(("status", "kind"), [
    (400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
    (413, "request_too_large"), (429, "rate_limit_error"), (500, "api_error"),
    (503, "overloaded_error"),
])
def test_errors_under_v1_messages_take_anthropics_shape(status: int, kind: str) -> None:
    error = APIError(status, "what went wrong", headers={"Retry-After": "1"})
    scope = {"path": "/v1/messages/count_tokens", "state": {"request_id": "abc"}}
    body = json.loads(error.response(scope).body)
    assert body == {"type": "error", "error": {"type": kind, "message": "what went wrong"},
                    "request_id": "abc"}
    scope["path"] = "/v1/responses"
    assert json.loads(error.response(scope).body)["error"]["message"] == "what went wrong"
    # Anthropic's SDKs name their API version in every request, to shared paths too.
    scope.update(path="/v1/models/nope", headers=[(b"anthropic-version", b"2023-06-01")])
    assert json.loads(error.response(scope).body)["error"]["type"] == kind


def test_a_busy_server_is_each_apis_own_busy_answer() -> None:
    """A full queue: OpenAI's 429, Anthropic's 529 overloaded_error (in a stream's error
    event too, where the status line went out while the model loaded), Ollama's 503."""
    busy = ServerBusy("the server is busy", 0.2)
    scope: dict[str, Any] = {"path": "/v1/chat/completions", "state": {"request_id": "abc"}}
    answers = {}
    for path in ("/v1/chat/completions", "/v1/messages", "/api/chat"):
        scope["path"] = path
        response = busy.response(scope)
        assert response.headers["retry-after"] == "1"
        answers[path] = response.status_code, json.loads(response.body)
    assert answers["/v1/chat/completions"][0] == 429
    assert answers["/v1/chat/completions"][1]["error"]["code"] == "rate_limit_exceeded"
    assert answers["/v1/messages"][0] == 529
    assert answers["/v1/messages"][1]["error"]["type"] == "overloaded_error"
    assert answers["/api/chat"] == (503, {"error": "the server is busy"})
    assert busy.anthropic_body("abc").error.type == "overloaded_error"
