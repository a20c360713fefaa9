"""Error objects for every failure, with the right status and nothing leaked.

Every error leaves in the shape of the API the request speaks: Anthropic's
`{"type": "error", "error": {"type", "message"}, "request_id"}` under /v1/messages and
to Anthropic's SDKs on shared paths, LM Studio's v1 `{"error": {"type", "message", "code",
"param"}}` under /api/v1, Hugging Face TEI's `{"error", "error_type"}` at /embed and /,
Cohere's `{"id", "message"}` at /v1/embed and /v2/embed, Ollama's `{"error": "..."}` under
the rest of /api but for LM Studio's v0 (/api/v0), which speaks OpenAI's, and OpenAI's
`{"error": {"message", "type", "param", "code"}}` everywhere else. That covers our own
`APIError`s, FastAPI's validation errors (400 instead of FastAPI's 422, as OpenAI does),
Starlette's routing errors (404/405) and, through the request middleware, unexpected
exceptions, which become a 500 naming the request id while the traceback stays in the
server log.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match, Route
from starlette.types import Scope

from server.anthropic.protocol import ErrorInfo as AnthropicErrorInfo
from server.anthropic.protocol import ErrorResponse as AnthropicErrorResponse
from server.anthropic.protocol import error_type as anthropic_error_type
from server.lmstudio.protocol import V1Error as LMStudioError
from server.lmstudio.protocol import V1ErrorResponse as LMStudioErrorResponse
from server.ollama.protocol import ErrorResponse as OllamaErrorResponse
from server.openai.protocol import ErrorInfo, ErrorResponse
from server.prefill.protocol import CohereErrorResponse, TeiErrorResponse

ANTHROPIC_PATH = "/v1/messages"
OLLAMA_PATH = "/api/"
# LM Studio's own API, inside Ollama's prefix: v0's errors are OpenAI's error object,
# v1's its own.
LMSTUDIO_V1_PATH = "/api/v1/"
LMSTUDIO_PATHS = ("/api/v0/", LMSTUDIO_V1_PATH)
# Hugging Face TEI's /embed, which no other API shares, and its base URL, which it
# answers as /embed (GET there is the probe, which does not fail).
TEI_EMBED_PATHS = ("/embed", "/")
# Cohere's embed API; its /v1/rerank and /v2/rerank are shared with llama.cpp's, vLLM's and
# Jina's clients, which read OpenAI's error object.
COHERE_EMBED_PATHS = ("/v1/embed", "/v2/embed")

# The keys the request's tagged unions choose their member by.
TAG_KEYS = {"type", "role"}
# Where FastAPI says a value was sent, the first part of a validation error's loc.
REQUEST_PARTS = ("body", "query", "path", "header", "cookie")

# How many validation problems one message lists; the rest are counted.
MAX_LISTED_PROBLEMS = 3
# OpenAI's codes for the validation problems it gives a code of their own, by pydantic's
# type for the problem (too_long: a list past its max_length); the rest are
# invalid_request.
VALIDATION_CODES = {"too_long": "array_above_max_length",
                    "integer_below_min_value": "integer_below_min_value",
                    "object_above_max_properties": "object_above_max_properties",
                    "string_above_max_length": "string_above_max_length"}
# The methods a 405's Allow header may name.
HTTP_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


class APIError(Exception):
    """A failure the client should see, as OpenAI's error object with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(
                message=self.message, type=error_type(self.status), param=self.param,
                code=self.code,
            )
        )

    def anthropic_body(self, request_id: str | None = None) -> AnthropicErrorResponse:
        return AnthropicErrorResponse(
            error=AnthropicErrorInfo(type=anthropic_error_type(self.status), message=self.message),
            request_id=request_id,
        )

    def lmstudio_body(self) -> LMStudioErrorResponse:
        """LM Studio v1's error: its type of error, and this one's code and param."""
        if self.code == "model_not_found":
            kind = "model_not_found"
        elif self.status < 500:
            kind = "invalid_request"
        else:
            kind = "not_implemented" if self.status == 501 else "internal_error"
        return LMStudioErrorResponse(error=LMStudioError(
            type=kind, message=self.message, code=self.code, param=self.param))

    def tei_body(self) -> TeiErrorResponse:
        """TEI's error, its kind by the status (TEI names no field: the message does)."""
        kinds = {429: "Overloaded", 503: "Unhealthy"}
        kind = kinds.get(self.status, "Backend" if self.status >= 500 else "Validation")
        return TeiErrorResponse(error=self.message, error_type=kind)

    def cohere_body(self, request_id: str | None = None) -> CohereErrorResponse:
        return CohereErrorResponse(id=request_id, message=self.message)

    def response(self, scope: Scope) -> JSONResponse:
        """The error in the shape of the API the request speaks; Anthropic's names the
        request in its body as well as in its header."""
        if speaks_anthropic(scope):
            body = self.anthropic_body(request_id_of(scope))
        elif scope["path"].startswith(LMSTUDIO_V1_PATH):
            body = self.lmstudio_body()
        elif scope["path"] in TEI_EMBED_PATHS:
            body = self.tei_body()
        elif scope["path"] in COHERE_EMBED_PATHS:
            body = self.cohere_body(request_id_of(scope))
        elif speaks_ollama(scope):
            body = OllamaErrorResponse(error=self.message)
        else:
            body = self.body()
        return JSONResponse(body.model_dump(), self.status, headers=self.headers)


class PromptTooLong(APIError):
    """A prompt that leaves no room for a reply in the context window: OpenAI's
    context_length_exceeded, and in Anthropic's shape the API's own words for it
    ("prompt is too long: N tokens > M maximum"), which Claude Code reads as the cue to
    compact its conversation."""

    def __init__(self, tokens: int, limit: int, param: str | None = None,
                 least: int | None = None) -> None:
        """`least`: the prompt, too long to be worth encoding, holds at least that many
        tokens by its length, and about `tokens` by a sample of it encoded."""
        counted = f"{tokens}" if least is None else f"at least {least} (about {tokens})"
        super().__init__(
            400, f"This model's maximum context length is {limit} tokens. However, your "
            f"prompt has {counted} tokens, which leaves no room for a reply.",
            code="context_length_exceeded", param=param)
        self.tokens, self.limit = tokens, limit

    def anthropic_body(self, request_id: str | None = None) -> AnthropicErrorResponse:
        return AnthropicErrorResponse(error=AnthropicErrorInfo(
            type=anthropic_error_type(self.status),
            message=f"prompt is too long: {self.tokens} tokens > {self.limit} maximum"),
            request_id=request_id)


class ServerBusy(APIError):
    """The queue is full. OpenAI's API says so as 429 rate_limit_exceeded; Anthropic's
    keeps 429 for an account's rate limit and says a busy service with 529
    overloaded_error, which Claude Code shows and retries as "overloaded"; Ollama's
    server answers a full queue with 503 ("server busy")."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(429, message, code="rate_limit_exceeded",
                         headers={"Retry-After": str(max(1, math.ceil(retry_after)))})

    def anthropic_body(self, request_id: str | None = None) -> AnthropicErrorResponse:
        """Also a stream's error event, where the status line went out first (a load)."""
        return AnthropicErrorResponse(
            error=AnthropicErrorInfo(type="overloaded_error", message=self.message),
            request_id=request_id)

    def response(self, scope: Scope) -> JSONResponse:
        answer = super().response(scope)
        if speaks_anthropic(scope):
            answer.status_code = 529
        elif speaks_ollama(scope):
            answer.status_code = 503
        return answer


@contextmanager
def params_renamed(names: Mapping[str, str]) -> Iterator[None]:
    """Within, an APIError's `param` is spelled as `names` says: the pipeline's refusals
    name Chat Completions' parameters, which another API (Responses, LM Studio's chat)
    calls otherwise."""
    try:
        yield
    except APIError as error:
        error.param = names.get(error.param, error.param)
        raise


def shown(text: str, most: int = 40) -> str:
    """A client's string as an error message quotes it: its first `most` characters (a
    20,000-character name echoed whole would make the error the largest thing sent)."""
    return repr(text if len(text) <= most else text[:most] + "...")


def request_id_of(scope: Scope) -> str | None:
    """The id the request middleware gave the request (none outside it)."""
    return scope.get("state", {}).get("request_id")


def speaks_anthropic(scope: Scope) -> bool:
    """A request to the Messages API, or from one of Anthropic's SDKs to a path both APIs
    share (/v1/models): they send `anthropic-version` with every request, and read an
    error by Anthropic's shape."""
    path = scope["path"]
    return (path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")
            or any(name == b"anthropic-version" for name, _ in scope.get("headers", ())))


def speaks_ollama(scope: Scope) -> bool:
    """A request to Ollama's native API (/api/...; LM Studio's share the prefix)."""
    path = scope["path"]
    return path.startswith(OLLAMA_PATH) and not path.startswith(LMSTUDIO_PATHS)


def error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def validation_error(errors: list[dict[str, Any]], body: Any = None) -> APIError:
    """One readable 400 from pydantic's list of problems in `body` (the parsed JSON)."""
    problems = []
    for error in errors:
        loc = [str(part) for part in _field_loc(error["loc"], body, error["type"])]
        if error["type"] == "json_invalid":
            # Its loc is a character position, not a field.
            position, loc = loc, []
            message = f"invalid JSON at character {''.join(position)}: {error['ctx']['error']}"
        elif error["type"] == "model_attributes_type" and not loc:
            message = "the body must be a JSON object (sent as Content-Type: application/json)"
        elif error["type"] == "value_error":
            message = str(error["ctx"]["error"])  # our validators' own words
        else:
            message = error["msg"]
        problems.append((loc, f"{'.'.join(loc)}: {message}" if loc else message))
    message = "; ".join(text for _, text in problems[:MAX_LISTED_PROBLEMS])
    if len(problems) > MAX_LISTED_PROBLEMS:
        message += f" (and {len(problems) - MAX_LISTED_PROBLEMS} more)"
    first_loc = problems[0][0] if problems else []
    first_type = errors[0]["type"] if errors else None
    return APIError(400, message, code=VALIDATION_CODES.get(first_type, "invalid_request"),
                    param=first_loc[0] if first_loc else None)


def _field_loc(loc: Sequence[str | int], body: Any, kind: str) -> Sequence[str | int]:
    """The field's path as the request spells it: without where it was sent (the body, the
    query string, the path: only the first part says that, so a field named "query" or
    "path" keeps its name), and without the tags of the unions on the way, which pydantic
    puts in it ("tools.0.function.name" is the request's "tools.0.name")."""
    if not loc or loc[0] not in REQUEST_PARTS:
        return loc
    if loc[0] != "body":
        return loc[1:]
    spelled = _spelled(body, list(loc[1:]), kind)
    return loc[1:] if spelled is None else spelled


def _spelled(node: Any, parts: list[str | int], kind: str) -> list[str | int] | None:
    """The parts of a validation error's path that walk the JSON `node` (None: no way
    through), for an error of pydantic's type `kind`. A part that is no key or index of
    where the walk stands is a union's tag, unless it is the last: a field the body lacks
    (missing, or checked though not sent) but for a tag naming the object's own type, or
    one that a type error or our validators' error (a value_error) names in an object of
    a tagged union (by "type" or "role"): that is the tag of the member that refused the
    object ("tools.0.server" is the request's "tools.0"). A value of the wrong type ends
    the walk where no other reading of the path gets through the body: what is left of
    it names the union's members the value was tried as ("input.str", an embeddings
    input sent as a number, is "input"; "documents.0.str", a number among rerank
    documents, "documents.0")."""
    if not parts:
        return []
    part, rest = parts[0], parts[1:]
    inside = _has(node, part)
    # A value no union member of its type could take: what is left names those tried.
    tried_as_members = (inside and not isinstance(node[part], dict | list)
                        and all(isinstance(tag, str) for tag in rest))
    if inside:
        walked = _spelled(node[part], rest, kind)
        if walked is not None:
            return [part, *walked]
        if tried_as_members and isinstance(part, int):  # an index is never a tag
            return [part]
    if (not rest and not inside and isinstance(node, dict) and TAG_KEYS & node.keys()
            and (kind == "value_error" or kind.endswith("_type"))):
        return []
    if not rest and (kind == "missing" or isinstance(node, dict) and node.get("type") != part):
        return [part]
    if isinstance(part, str) and isinstance(node, dict | list):
        skipped = _spelled(node, rest, kind)
        if tried_as_members and (skipped is None or not _in_body(node, skipped)):
            return [part]
        return skipped
    return None


def _in_body(node: Any, path: list[str | int]) -> bool:
    for part in path:
        if not _has(node, part):
            return False
        node = node[part]
    return True


def _has(node: Any, part: str | int) -> bool:
    """Whether `part` is a key of the JSON object `node`, or an index of the array."""
    return (isinstance(node, dict) and part in node
            or isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node))


async def _api_error(request: Request, error: APIError) -> JSONResponse:
    return error.response(request.scope)


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    return validation_error(list(error.errors()), error.body).response(request.scope)


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    codes = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed",
             415: "unsupported_media_type"}
    headers = dict(error.headers or {})
    if error.status_code == 405:
        headers["Allow"] = ", ".join(_allowed_methods(request))
    return APIError(
        error.status_code, str(error.detail), code=codes.get(error.status_code),
        headers=headers,
    ).response(request.scope)


def _allowed_methods(request: Request) -> list[str]:
    """The methods the request's path takes: Starlette names only the first route of the
    path (a path may have several), so each method is matched as a request would be. A
    path spelled out by a route is that route's resource, not also an id in a templated
    one (`/v1/responses/input_tokens` is no response's id)."""
    matches = [(method, route) for method in HTTP_METHODS
               for route in _routes(request.app.router.routes)
               if route.matches({**request.scope, "method": method})[0] is Match.FULL]
    spelled = [(method, route) for method, route in matches if not route.param_convertors]
    methods = [method for method, _ in spelled or matches]
    if "GET" in methods:  # server/http/head.py answers it
        methods.append("HEAD")
    return sorted(set(methods), key=HTTP_METHODS.index)


def _routes(routes: list[BaseRoute]) -> Iterator[Route]:
    """The app's routes, through the routers it includes (whole, as FastAPI >= 0.165
    includes them, with their routes' own paths: the app gives them no prefix)."""
    for route in routes:
        included = getattr(route, "original_router", None)
        yield from _routes(included.routes) if included is not None else (route,)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
