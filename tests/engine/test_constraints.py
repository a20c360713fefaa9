"""The constraint builders the server calls: what they refuse, and what they name."""

from __future__ import annotations

import dataclasses

import pytest

from engine.constraints import (
    FunctionTool,
    UnsupportedSchema,
    json_object,
    json_schema,
    tool_calls,
)

WEATHER = FunctionTool("get_weather", {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


@pytest.mark.parametrize(("schema", "keyword"), [
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "string", "format": "no-such-format"}, "format"),
    ({"type": "strng"}, "type"),
    ({"$ref": "#/$defs/missing"}, "$ref"),
    ({"type": "string", "pattern": "(("}, "pattern"),
])
def test_strict_schema_the_engine_cannot_enforce_is_refused_naming_the_keyword(schema, keyword):
    with pytest.raises(UnsupportedSchema) as refused:
        json_schema(schema, strict=True)
    assert refused.value.keyword == keyword


def test_non_strict_schema_ignores_keywords_it_cannot_enforce():
    schema = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
    assert json_schema(schema, strict=False).grammar


def test_malformed_schema_is_refused_even_when_not_strict():
    with pytest.raises(UnsupportedSchema):
        json_schema({"type": "strng"}, strict=False)
    with pytest.raises(UnsupportedSchema):
        json_schema(["not", "a", "schema"], strict=False)  # type: ignore[arg-type]


def test_equal_schemas_give_equal_constraints():
    """The engine caches compiled grammars by the constraint's grammar text."""
    assert json_object() == json_object()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    assert json_schema(schema) == json_schema(dict(schema))


def test_tool_calls_name_the_function_whose_parameters_are_refused():
    bad = FunctionTool("dedupe", {"type": "object", "properties": {
        "ids": {"type": "array", "uniqueItems": True}}}, strict=True)
    with pytest.raises(UnsupportedSchema, match="dedupe") as refused:
        tool_calls([WEATHER, bad])
    assert refused.value.keyword == "uniqueItems"


def test_a_named_function_must_be_among_the_tools():
    with pytest.raises(ValueError, match="no function named 'missing'"):
        tool_calls([WEATHER], name="missing")
    with pytest.raises(ValueError):
        tool_calls([])


def test_reasoning_marker_is_set_on_the_built_constraint():
    constraint = dataclasses.replace(json_object(), after="</think>")
    assert constraint.after == "</think>" and constraint.grammar == json_object().grammar
