"""JSON Schemas rewritten for generation before llguidance compiles them.

Two rewrites, both keeping every output valid against the schema as given:

- closing objects: an object that lists its `properties` and says nothing of
  `additionalProperties` allows any other key by JSON Schema's rules. A small model that
  has written the listed keys then tends to invent keys until max_tokens, repeats
  included (llguidance allows them among extra keys; engine/json_keys.py masks them).
  pydantic's default schemas, which instructor sends, are all like this.
  llama.cpp's converter and OpenAI's strict mode close such objects to their listed
  properties; so does `closed_objects`, unless told otherwise. An object that says
  `additionalProperties` (true, false or a schema) keeps its word.
- required first: llguidance writes properties in the order of `properties`; listing the
  required ones first means a reply cut short by max_tokens, or one that skips the
  optional keys, still has what the schema requires (llama.cpp orders them so too).

An object whose keys other keywords also decide (`allOf`, `anyOf`, `oneOf`, `$ref`
beside `properties`, or a member of an `allOf` of several schemas) is left as written:
there the properties of one part are extra keys of another, so closing a part would
refuse valid objects, and llguidance's merge fixes the order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

# Keywords whose value is a map of names to subschemas.
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Keywords whose value is one subschema (`items` may also be a list: draft 4's tuples).
SCHEMA_VALUES = ("items", "additionalItems", "unevaluatedItems", "additionalProperties",
                 "unevaluatedProperties", "propertyNames", "contains", "not", "if", "then",
                 "else")
# Keywords whose value is a list of subschemas.
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
# Keywords that make an object's keys depend on other schemas too.
COMBINATORS = ("allOf", "anyOf", "oneOf", "$ref")
# llguidance 1.9 crashes the process (SIGSEGV) compiling an integer whose maximum lies
# within ~512 of the smallest 64-bit integer, where it overflows; nothing real asks that.
LOWEST_MAXIMUM = -(2**63) + 2**20


def for_generation(schema: Any, close_objects: bool) -> Any:
    """`schema` with required properties listed first and, if `close_objects`, objects
    that list properties closed to them (see the module docstring). The input is not
    changed."""
    return _rewrite(schema, close_objects, standalone=True)


def strict_mode(schema: Any) -> Any:
    """`schema` normalized to OpenAI's strict mode, as the Responses API does with a
    function's parameters where `strict` is unsaid: an object that lists its properties
    requires every one of them, and is closed to them unless it says otherwise. The input
    is not changed."""
    return _rewrite(schema, close=True, standalone=True, require_all=True)


def _rewrite(schema: Any, close: bool, standalone: bool, require_all: bool = False) -> Any:
    """`standalone`: no sibling schema shares this one's keys (not a member of a
    several-schema `allOf`). `require_all`: every listed property becomes required."""
    if not isinstance(schema, Mapping):
        return schema  # true / false schemas
    out = dict(schema)
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: _rewrite(sub, close, True, require_all)
                        for name, sub in out[key].items()}
    for key in SCHEMA_VALUES:
        if isinstance(out.get(key), Mapping):
            out[key] = _rewrite(out[key], close, True, require_all)
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            alone = key != "allOf" or len(out[key]) == 1
            out[key] = [_rewrite(sub, close, alone, require_all) for sub in out[key]]
    properties = out.get("properties")
    if not (standalone and isinstance(properties, Mapping)) or any(
            key in out for key in COMBINATORS):
        return out

    def unlisted(name: Any) -> bool:
        return not (isinstance(name, str) and name in properties)

    if require_all:
        given = out.get("required")
        # An entry that is not a listed name stays, for the grammar's check to judge.
        out["required"] = [*properties, *(name for name in given if unlisted(name))
                           ] if isinstance(given, list) else list(properties)
    required = out.get("required")
    if isinstance(required, list):
        first = [name for name in properties if name in required]
        out["properties"] = {name: properties[name]
                             for name in first + [n for n in properties if n not in first]}
    # A required name that is not listed can only come in as an extra key.
    extra_required = isinstance(required, list) and any(unlisted(name) for name in required)
    if close and not extra_required and not any(
            key in out for key in ("additionalProperties", "unevaluatedProperties")):
        out["additionalProperties"] = False
    return out


def subschemas(schema: Any) -> Iterator[Mapping[str, Any]]:
    """`schema` and every schema inside it, wherever a keyword holds one (true and false
    schemas left out)."""
    if not isinstance(schema, Mapping):
        return
    yield schema
    for key in SCHEMA_MAPS:
        if isinstance(schema.get(key), Mapping):
            for sub in schema[key].values():
                yield from subschemas(sub)
    for key in SCHEMA_VALUES:
        if isinstance(schema.get(key), Mapping):
            yield from subschemas(schema[key])
    for key in SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for sub in schema[key]:
                yield from subschemas(sub)


def too_low_maximum(schema: Any) -> tuple[str, float] | None:
    """The first `maximum` or `exclusiveMaximum` anywhere in `schema` at or below
    LOWEST_MAXIMUM, and its value; None if there is none."""
    for sub in subschemas(schema):
        for keyword in ("maximum", "exclusiveMaximum"):
            value = sub.get(keyword)
            if isinstance(value, int | float) and not isinstance(value, bool) \
                    and value <= LOWEST_MAXIMUM:
                return keyword, value
    return None
