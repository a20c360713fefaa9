"""The grammar a request's output follows, built in process: each schema is checked once,
and a refused one is a 400 naming the parameter it came from."""

from __future__ import annotations

from typing import Any

import pytest

from engine import constraints
from engine.tokenizer import ToolCallFormat
from server.http.errors import APIError
from server.request import FunctionTool, GenerationRequest, JsonSchemaOutput
from server.structured import output_constraint

ANSWER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = FunctionTool("get_weather", parameters={
    "type": "object", "properties": {"where": {"type": "string"}}})
HERMES = ToolCallFormat("<tool_call>", "</tool_call>", parse=lambda text, tools: text)


def request(schema: dict[str, Any], **fields: Any) -> GenerationRequest:
    return GenerationRequest(
        messages=({"role": "user", "content": "weather?"},), tools=(WEATHER,),
        output=JsonSchemaOutput("answer", schema, strict=True), **fields)


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_the_answers_schema_is_compiled_once_beside_tools(
        monkeypatch: pytest.MonkeyPatch, tool_choice: str) -> None:
    compiled = []
    real = constraints._grammar_from_schema

    def counting(schema: Any, strict: bool, close_objects: bool) -> str:
        compiled.append(schema)
        return real(schema, strict, close_objects)

    monkeypatch.setattr(constraints, "_grammar_from_schema", counting)
    assert output_constraint(request(ANSWER, tool_choice=tool_choice), HERMES, None)
    assert compiled.count(ANSWER) == 1
    assert compiled.count(WEATHER.parameters) == 1


@pytest.mark.parametrize("tool_choice", ["auto", "required", "none"])
def test_a_refused_answer_schema_beside_tools_names_response_format(tool_choice: str) -> None:
    unenforceable = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
    with pytest.raises(APIError) as refused:
        output_constraint(request(unenforceable, tool_choice=tool_choice), HERMES, None)
    assert refused.value.param == "response_format"
    assert "uniqueItems" in refused.value.message
