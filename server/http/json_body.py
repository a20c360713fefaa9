"""Request bodies parsed once, by jiter (pydantic's JSON parser), for every route.

FastAPI parses a JSON body with `Request.json()`, Python's json module. That module
accepts a lone UTF-16 surrogate escape (\\ud800) and NaN, which are not valid Unicode or
JSON: a surrogate then fails a tokenizer deep inside a request. jiter refuses both. So
routes use `JSONRoute`, whose requests parse with jiter alone, and a body either module
refuses is a 400 that names the place. A UTF-8 byte order mark in front of the text is
skipped, as RFC 8259 lets a parser do: Windows editors and PowerShell 5's `Out-File`
write one, and a body saved by them and sent with `curl -d @file` is otherwise valid.
"""

from __future__ import annotations

import codecs
import gc
from collections.abc import Awaitable, Callable
from typing import Any

import pydantic_core
from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect

from server.http.streaming import CLIENT_CLOSED

# jiter's words where a string's \uXXXX escape is a lone UTF-16 surrogate (\ud800-\udfff
# not in a high-low pair): they say where its parser stopped, not what is wrong.
LONE_SURROGATE_WORDS = ("unexpected end of hex escape", "lone leading surrogate in hex escape")
LONE_SURROGATE = ("a string holds an invalid unicode escape, a lone surrogate "
                  "(\\ud800-\\udfff not in a high-low pair),")


class JSONRequest(Request):
    async def body(self) -> bytes:
        """The JSON text, without a byte order mark. An empty body reads as `{}`, so a
        400 names each required field it lacks rather than the whole body. A compressed
        one is refused as such, not read as invalid JSON (or, labelled but plain, read
        as if it were not)."""
        encoding = self.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise HTTPException(415, f"the body is sent with Content-Encoding {encoding!r}: "
                                     "send it uncompressed")
        try:
            body = await super().body()
        except ClientDisconnect:
            # The client left mid-body: FastAPI would call it a body it could not parse
            # (a 400 in the access log, the request blamed); nobody reads the answer.
            raise HTTPException(CLIENT_CLOSED, "the client closed the connection before "
                                               "its body was sent") from None
        return body.removeprefix(codecs.BOM_UTF8) or b"{}"

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = _parsed(body)
            except ValueError as error:
                # FastAPI passes an HTTPException on as it is (our 400 invalid_request);
                # any other error here would become its own vaguer 400.
                raise HTTPException(
                    400, f"the body is not valid JSON text: {_described(error)}") from None
        return self._json


def _parsed(body: bytes) -> Any:
    """`body` parsed with the cyclic garbage collector paused: JSON holds no cycles, and
    the collections its many containers set off made a 4 MB body of empty arrays take
    0.71 s of the event loop instead of 0.22."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        return pydantic_core.from_json(body, allow_inf_nan=False)
    finally:
        if collecting:
            gc.enable()


def _described(error: ValueError) -> str:
    """jiter's message, with a lone surrogate called what it is."""
    message = str(error)
    for words in LONE_SURROGATE_WORDS:
        message = message.replace(words, LONE_SURROGATE)
    return message


class JSONRoute(APIRoute):
    """The route class of every router: its handler sees a JSONRequest."""

    any_content_type = False  # read the body as JSON whatever its Content-Type says

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def with_json_request(request: Request) -> Response:
            scope = request.scope
            # Also where no body is read (loading a model, flushing a cache): a page sends
            # such a POST as easily as a form.
            refuse_a_web_pages_post(request)
            if self.any_content_type:
                scope = _labelled_json(scope)
            return await handler(JSONRequest(scope, request.receive))

        return with_json_request


class AnyTypeJSONRoute(JSONRoute):
    """Ollama's and llama.cpp's native routes: a body is JSON whatever its Content-Type
    says, as their servers read it (Ollama binds the body as JSON; llama.cpp parses
    `req.body`, and raised cpp-httplib's limit on form bodies for it). Ollama's own
    documented examples (`curl .../api/generate -d '{...}'`) send curl's default,
    application/x-www-form-urlencoded, and so do scripts written against llama.cpp's
    `/completion` without a header."""

    any_content_type = True


def refuse_a_web_pages_post(request: Request) -> None:
    """A POST with a body of a type a web form or a no-cors fetch can send (no CORS
    preflight: a form type, text/plain, or none at all) from a page on another origin: any
    site the user visits could make a keyless local server act (generate, load or unload a
    model, flush its cache). curl and routers send no Origin; a page of an origin CORS
    allows sends JSON as JSON. Other methods that act (DELETE, PUT) always ask CORS first."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if ("origin" in request.headers and request.method == "POST"
            and media_type != "application/json"):
        body = f"a {media_type} body" if media_type else "a POST without a typed body"
        raise HTTPException(403, f"{body} from the web page at "
                                 f"{request.headers['origin']} is refused: send JSON as "
                                 "application/json")


def _labelled_json(scope: dict[str, Any]) -> dict[str, Any]:
    headers = [(name, value) for name, value in scope["headers"] if name != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
