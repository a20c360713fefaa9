"""A request's JSON body is parsed once, strictly (server/http/json_body.py), on an app whose
engine is never started: the body is read before the route answers that it is loading."""

from __future__ import annotations

import codecs
import gzip
import json
from typing import Any

import pydantic_core
import pytest

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}


async def test_a_body_is_parsed_once(loading_app, monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted at both parsers a body could go through: Python's json and jiter."""
    body = json.dumps(CHAT).encode()
    parsed: list[str] = []

    def counting(parser: Any, name: str) -> Any:
        def parse(data: Any, *args: Any, **kwargs: Any) -> Any:
            if data == body:
                parsed.append(name)
            return parser(data, *args, **kwargs)
        return parse

    monkeypatch.setattr(json, "loads", counting(json.loads, "json"))
    monkeypatch.setattr(pydantic_core, "from_json", counting(pydantic_core.from_json, "jiter"))
    response = await loading_app.post("/v1/chat/completions", content=body,
                                      headers={"content-type": "application/json"})
    assert response.status_code == 503  # loading: the body was read and validated first
    assert parsed == ["jiter"]


async def json_error(loading_app, path: str, content: bytes) -> dict:
    """The error object of the 400 that `content`, sent as JSON, gets."""
    response = await loading_app.post(path, content=content,
                                      headers={"content-type": "application/json"})
    assert response.status_code == 400
    return response.json()["error"]


@pytest.mark.parametrize(("path", "text", "problem"), [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
     ("an invalid unicode escape, a lone surrogate (\\ud800-\\udfff not in a high-low "
      "pair), at line 1")),
    ("/v1/embeddings", b'{"input": "\\udc00 and \\ud800\\u0041"}', "a lone surrogate"),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', "expected value"),
    ("/v1/chat/completions", b'{"messages": [', "EOF while parsing a list at line 1"),
])
async def test_what_jiter_refuses_is_a_400_naming_the_place(
        loading_app, path: str, text: bytes, problem: str) -> None:
    error = await json_error(loading_app, path, text)
    assert error["code"] == "invalid_request"
    assert error["message"].startswith("the body is not valid JSON text: ")
    assert problem in error["message"]


async def test_a_byte_order_mark_before_the_text_is_skipped(loading_app) -> None:
    """A body saved with a UTF-8 BOM (Windows editors, PowerShell 5's Out-File) reads as
    its JSON; a BOM alone as an empty body."""
    bom = codecs.BOM_UTF8
    response = await loading_app.post("/v1/chat/completions", content=bom + json.dumps(CHAT).encode(),
                                      headers={"content-type": "application/json"})
    assert response.status_code == 503  # loading: the body was read and validated first
    error = await json_error(loading_app, "/v1/chat/completions", bom)
    assert error["param"] == "messages" and error["message"].startswith("messages: Field required")


@pytest.mark.parametrize("content", [b"", b"{}"])
@pytest.mark.parametrize(("path", "param"), [
    ("/v1/embeddings", "input"), ("/v1/rerank", "query"), ("/v1/chat/completions", "messages"),
])
async def test_an_empty_body_is_a_400_naming_the_first_field_it_lacks(
        loading_app, content: bytes, path: str, param: str) -> None:
    error = await json_error(loading_app, path, content)
    assert error["param"] == param and error["message"].startswith(f"{param}: Field required")


async def test_the_messages_api_says_it_in_its_own_shape(loading_app) -> None:
    response = await loading_app.post("/v1/messages", content=b'{"model": "x", "max_tokens": NaN}',
                                      headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["type"] == "error"
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("encoding", ["gzip", "br"])
async def test_a_compressed_body_is_a_415_not_invalid_json(loading_app, encoding: str) -> None:
    """A gzipped body was a 400 "not valid JSON", and a plain one labelled gzip was read
    as plain: the label says what the bytes are, and none is decompressed here."""
    content = gzip.compress(json.dumps(CHAT).encode()) if encoding == "gzip" else \
        json.dumps(CHAT).encode()
    response = await loading_app.post("/v1/chat/completions", content=content, headers={
        "content-type": "application/json", "content-encoding": encoding})
    assert response.status_code == 415
    error = response.json()["error"]
    assert error["code"] == "unsupported_media_type" and "uncompressed" in error["message"]
