"""A 400's message names each problem by the path the request spells: the unions'
member names pydantic puts in an error's location stay out of it."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from server.anthropic.protocol import MessagesRequest
from server.http.errors import validation_error
from server.openai.protocol import ChatCompletionRequest, CompletionRequest
from server.prefill.protocol import RerankRequest
from server.responses.protocol import ResponsesRequest

USER = [{"role": "user", "content": "hi"}]


def message_of(model: type[BaseModel], body: dict[str, Any]) -> tuple[str | None, str]:
    """The (param, message) of the 400 for `body`, as FastAPI reports it (in the body)."""
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    errors = [{**error, "loc": ("body", *error["loc"])} for error in caught.value.errors()]
    error = validation_error(errors, body)
    return error.param, error.message


@pytest.mark.parametrize(("model", "body", "param", "message"), [
    (RerankRequest, {"query": "q", "documents": ["a", 5]}, "documents",
     "documents.1: must be a string or an object (its text, or the fields rank_fields names)"),
    (MessagesRequest, {"model": "m", "max_tokens": 5, "messages": USER,
                       "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools", "tools.0: 'web_search_20250305' tools are not supported"),
    (MessagesRequest, {"model": "m", "max_tokens": 5, "messages": USER,
                       "system": [{"type": "image", "source": {}}]},
     "system", "system.0: content blocks of type 'image' are not supported"),
    (MessagesRequest, {"model": "m", "max_tokens": 5,
                       "messages": [{"role": "user", "content": [{"type": "weird"}]}]},
     "messages", "messages.0.content.0: content blocks of type 'weird' are not supported"),
    (ResponsesRequest, {"input": [{"type": "weird"}]}, "input",
     "input.0: input items of type 'weird' are not supported"),
    (ChatCompletionRequest, {"messages": [*USER, {"role": "assistant"}]}, "messages",
     "messages.1: an assistant message needs content"),
    (ChatCompletionRequest, {"messages": USER, "tools": [
        {"type": "function", "function": {"name": 5}}]}, "tools",
     "tools.0.function.name: Input should be a valid string"),
], ids=["a number among documents", "an Anthropic server tool", "an image as system",
        "an unknown content block", "an unknown input item", "an empty assistant message",
        "a field inside a union member"])
def test_a_problem_is_named_by_the_requests_own_path(
        model: type[BaseModel], body: dict[str, Any], param: str, message: str) -> None:
    assert message_of(model, body)[0] == param
    assert message_of(model, body)[1].startswith(message)


def test_a_field_checked_though_not_sent_keeps_its_name() -> None:
    """echo is validated by default: a completion of nothing must echo its prompt."""
    assert message_of(CompletionRequest, {"prompt": "hi", "max_tokens": 0}) == (
        "echo", "echo: with max_tokens 0 (no completion) echo must be true")
