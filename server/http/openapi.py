"""What the OpenAPI schema declares for the API routes: each API's error object for
every failure, and the events of its streams."""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter

ERROR_DESCRIPTIONS: dict[int | str, str] = {
    400: "Invalid request, or prompt + max_tokens over the context window.",
    401: "Missing or wrong API key.",
    404: "Unknown model (or stored response).",
    413: "Body over the server's max_body_bytes.",
    429: "Queue full (/v1/messages: 529 overloaded_error); retry after Retry-After seconds.",
    500: "The engine failed this request; the message names the request id.",
    503: "The model is loading or failed to load, or the server is shutting down.",
    # Covers the rest (e.g. 405) and keeps FastAPI from declaring a 422 we never send.
    "4XX": "Any other client error.",
}


def error_responses(error: type) -> dict[int | str, dict[str, Any]]:
    """Every failure status, answered with the API's `error` object."""
    return {
        status: {"model": error, "description": description}
        for status, description in ERROR_DESCRIPTIONS.items()
    }


def inline(kind: Any) -> dict[str, Any]:
    """`kind`'s JSON schema with its definitions inlined: nothing else refers to them."""
    schema = TypeAdapter(kind).json_schema(mode="serialization")
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return resolve(defs[node["$ref"].rsplit("/", 1)[1]])
            return {key: resolve(value) for key, value in node.items()}
        return [resolve(item) for item in node] if isinstance(node, list) else node

    return resolve(schema)


def event_stream(events: Any, error: type, done: bool = False) -> dict[str, Any]:
    """A stream's events: `events`, or an `error` object (a failure after the status line
    was sent), then `[DONE]` where the API ends its streams with it."""
    data: dict[str, Any] = {
        "type": "string", "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [inline(events), inline(error)]},
    }
    if done:
        data = {"anyOf": [{"const": "[DONE]"}, data]}
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return {"text/event-stream": {"schema": event}}


def json_lines(lines: Any, error: type) -> dict[str, Any]:
    """A stream of JSON lines (Ollama's): each line one of `lines`, or an `error` object
    (a failure after the status line was sent)."""
    return {"application/x-ndjson": {"schema": inline(lines | error)}}
