"""The pydantic bases every API's schema builds on.

Requests validate strictly (`"n": "2"` is a 400, not a silent coercion) and ignore unknown
fields, as OpenAI and Anthropic do, and null for an optional field is its default: the
OpenAI SDK sends null for an argument given as None, and frameworks forward every option
they hold. Responses forbid fields they do not declare, so a typo in a front end fails its
tests instead of reaching a client.
"""

from __future__ import annotations

import functools
import time
import types
from collections.abc import Collection
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    model_validator,
)
from pydantic_core import PydanticCustomError

# The likeliest alternatives a token's logprob may come with, in every API (OpenAI's 20).
MAX_TOP_LOGPROBS = 20
# A response format's name, as OpenAI checks it in both of its APIs.
FormatName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
# LM Studio's `ttl`, which its OpenAI-compatible requests carry: how many seconds the
# model (one of several) stays loaded, idle, after the request; none: its idle timeout.
# Bounded (68 years) because an unbounded int overflowed /api/ps' float clock into a 500.
IdleTtl = Annotated[int, Field(ge=0, le=2**31 - 1)]
# The tools one request may offer in OpenAI's APIs (OpenAI's 128). Refused as they are
# validated: thousands took seconds of rendering and tokenizing, every other stream
# stalled meanwhile, only to be refused as too long.
MAX_TOOLS = 128
# The most stop strings one request may give. OpenAI's `stop` takes 4, but Continue sends
# its template's 9 with 3 of its own to any server but OpenAI's (vLLM, llama.cpp and
# Ollama take any number), and Anthropic's stop_sequences take more.
MAX_STOP_STRINGS = 64
StopStrings = Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)]


def _nullable_defaults(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """The JSON schema (the OpenAPI document) allows what `_null_is_unset` takes: null for
    each optional field that holds no null."""
    properties = schema.get("properties", {})
    for name in _defaulted_without_null(model) & properties.keys():
        field = properties[name]
        notes = {key: field.pop(key) for key in ("title", "description", "default")
                 if key in field}
        properties[name] = {"anyOf": [field, {"type": "null"}], **notes}


class RequestModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=_nullable_defaults)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """Drop nulls sent for optional fields that hold no null (`"n": null`, `"stream":
        null`): each takes its default, as an absent one does."""
        if isinstance(data, dict) and None in data.values():
            unset = _defaulted_without_null(cls)
            return {key: value for key, value in data.items()
                    if value is not None or key not in unset}
        return data

    @model_validator(mode="before")
    @classmethod
    def _one_name_each(cls, data: Any) -> Any:
        """A field that goes by several names (TEI's `texts` for `documents`, vLLM's
        `text_1` for `queries`) sent under two of them is a 400, not one of the two
        silently dropped."""
        if isinstance(data, dict):
            for names in _alias_choices(cls):
                sent = [name for name in names if name in data]
                if len(sent) > 1:
                    raise ValueError(f"{' and '.join(map(repr, sent))} are one field's "
                                     "names: send one of them")
        return data


@functools.cache
def _alias_choices(model: type[BaseModel]) -> list[list[str]]:
    """The names of each of `model`'s fields that has several."""
    return [[choice for choice in field.validation_alias.choices if isinstance(choice, str)]
            for field in model.model_fields.values()
            if isinstance(field.validation_alias, AliasChoices)]


@functools.cache
def _defaulted_without_null(model: type[BaseModel]) -> frozenset[str]:
    """The names (as sent) of `model`'s fields that have a default and do not take None."""
    return frozenset(field.alias or name for name, field in model.model_fields.items()
                     if not field.is_required() and not _takes_none(field.annotation))


def _takes_none(annotation: Any) -> bool:
    if annotation is None or annotation is type(None) or annotation is Any:
        return True
    if get_origin(annotation) is Annotated:
        return _takes_none(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        return any(_takes_none(member) for member in get_args(annotation))
    return False


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


def tool_choice_union(**objects: Any) -> Any:
    """OpenAI's tool_choice: a mode, or one of `objects` by its type, each API's own
    shapes (function=, allowed_tools=, custom=)."""
    names = {"function": "a function", "custom": "a custom tool",
             "allowed_tools": "allowed tools"}
    shapes = [names[kind] for kind in objects]
    return shaped_union(
        lambda value: _tool_choice_kind(value, objects),
        f'a mode ("none", "auto" or "required"), {", ".join(shapes[:-1])}, or {shapes[-1]}',
        mode=Literal["none", "auto", "required"], **objects,
    )


def _tool_choice_kind(value: Any, objects: dict[str, Any]) -> str | None:
    """A mode, or an object by its type."""
    return "mode" if isinstance(value, str) else type_of(value, objects)


def type_of(value: Any, kinds: Collection[str]) -> str | None:
    """An object's `type` where it is one of `kinds`, for `shaped_union`: read from a
    request's JSON, or from its model, which a response echoes."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if isinstance(kind, str) and kind in kinds else None


def str_or_list(value: Any) -> str | None:
    """"str" or "list", for a `shaped_union` of a string and a list of parts."""
    return "str" if isinstance(value, str) else "list" if isinstance(value, list) else None


class RefusalPart(RequestModel):
    """An assistant's refusal, a content part of OpenAI's output that clients send back as
    input (the Agents SDK's to_input_list, a replayed chat): read as its text."""

    type: Literal["refusal"]
    refusal: str

    @property
    def text(self) -> str:
        return self.refusal


def _object_schema(schema: dict[str, Any]) -> dict[str, Any]:
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise ValueError(f"a tool's parameters are a JSON object: its schema must be of type "
                         f"'object', not {kind!r}")
    # Said outright, or a forced call's grammar, built from the schema, would admit any
    # value (`true`, a string, an array) where arguments must be an object.
    return {**schema, "type": "object"}


# A tool's parameters (input schema): what a call's arguments, a JSON object, satisfy. A
# schema that names no type (as clients often leave it out), or a list of types with
# "object" in it, is taken as an object's.
ObjectSchema = Annotated[dict[str, Any], AfterValidator(_object_schema)]


# OpenAI's bounds on a request's metadata, in both of its APIs.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


def _bounded_metadata(metadata: dict[str, str]) -> dict[str, str]:
    """OpenAI's 400s, codes and words for metadata past its bounds, which a client that
    works here would otherwise first meet on OpenAI."""
    if len(metadata) > MAX_METADATA_PAIRS:
        raise PydanticCustomError(
            "object_above_max_properties", "too many properties. Expected an object with at "
            "most {most} properties, but got an object with {count} properties instead.",
            {"most": MAX_METADATA_PAIRS, "count": len(metadata)})
    for key, value in metadata.items():
        for what, text, most in (("the key", key, MAX_METADATA_KEY),
                                 ("the value of", value, MAX_METADATA_VALUE)):
            if len(text) > most:
                raise PydanticCustomError(
                    "string_above_max_length", "string too long ({what} '{key}'). Expected a "
                    "string with maximum length {most}, but got a string with length {length} "
                    "instead.", {"what": what, "key": key[:MAX_METADATA_KEY], "most": most,
                                 "length": len(text)})
    return metadata


# Key-value pairs a client attaches to a request (OpenAI's `metadata`), strings only.
Metadata = Annotated[dict[str, str], AfterValidator(_bounded_metadata)]


def check_tool_names(names: list[str]) -> None:
    """Each tool's name once: a model calls a tool by its name, so two of one name would
    leave a call ambiguous."""
    if repeated := sorted({name for name in names if names.count(name) > 1}):
        raise ValueError("tool names must be unique: "
                         f"{', '.join(map(repr, repeated))} given more than once")


def now() -> int:
    return int(time.time())
