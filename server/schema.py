"""The pydantic bases every API's schema builds on.

Requests validate strictly (`"n": "2"` is a 400, not a silent coercion) and ignore unknown
fields, as OpenAI and Anthropic do; responses forbid fields they do not declare, so a typo
in a front end fails its tests instead of reaching a client.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Tag


class RequestModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


def shaped_union(kind: Any, what: str, **members: Any) -> Any:
    """A union validated by just the member that `kind(value)` names, so a bad value gets
    that member's errors instead of one per member; a value of no known shape gets
    "must be <what>"."""
    return Annotated[
        Union[tuple(Annotated[member, Tag(tag)] for tag, member in members.items())],  # noqa: UP007
        Discriminator(
            kind, custom_error_type="invalid_type", custom_error_message=f"must be {what}"
        ),
    ]


def tool_choice_union(function: Any, allowed_tools: Any) -> Any:
    """OpenAI's tool_choice, with each API's own shapes of a named function and of
    allowed tools."""
    return shaped_union(
        _tool_choice_kind, 'a mode ("none", "auto" or "required"), a function, or allowed tools',
        mode=Literal["none", "auto", "required"], function=function,
        allowed_tools=allowed_tools,
    )


def _tool_choice_kind(value: Any) -> str | None:
    """A mode, or an object by its type (a request's JSON, or its model, which a response
    echoes)."""
    if isinstance(value, str):
        return "mode"
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("function", "allowed_tools") else None


def now() -> int:
    return int(time.time())
