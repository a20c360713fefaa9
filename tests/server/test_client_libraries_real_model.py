"""What client libraries send, on the real default model (SmolLM2-135M-Instruct):
instructor's structured extraction, whose pydantic schemas leave objects open."""

from __future__ import annotations

import json

import instructor
import openai
import pytest
from pydantic import BaseModel

from tests.server.support import API_KEY, ServerProcess

GREEDY = {"temperature": 0.0}
# Left open, the model's reply to this went on past the listed keys:
# {"name": "John Doe", "age": 42, "age_range": "18-25", "description": ...
EXTRACT = [{"role": "user", "content":
            "John Doe, age 42, works as a senior data scientist at Acme."}]
ROOM = 100


class Person(BaseModel):
    """pydantic's default schema: no additionalProperties, so open by JSON Schema's rules."""

    name: str
    age: int


@pytest.fixture(scope="module")
def model(real_model_dir) -> str:
    return real_model_dir.name


@pytest.fixture(scope="module")
def client(real_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{real_server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA])
def test_instructor_extracts_a_person(client: openai.OpenAI, model: str,
                                      mode: instructor.Mode) -> None:
    extractor = instructor.from_openai(client, mode=mode)
    person, completion = extractor.chat.completions.create_with_completion(
        model=model, response_model=Person, messages=EXTRACT, max_tokens=ROOM,
        max_retries=0, **GREEDY)
    assert person.model_dump() == {"name": "John Doe", "age": 42}
    message = completion.choices[0].message
    written = message.tool_calls[0].function.arguments if message.tool_calls else message.content
    assert list(json.loads(written)) == ["name", "age"]


def test_a_forced_call_on_a_default_schema_writes_only_its_keys(client: openai.OpenAI,
                                                                 model: str) -> None:
    class Optional_(BaseModel):
        note: str = ""
        name: str
        age: int

    tool = {"type": "function", "function": {"name": "record",
                                             "parameters": Optional_.model_json_schema()}}
    response = client.chat.completions.create(
        model=model, messages=EXTRACT, tools=[tool], max_tokens=ROOM,
        tool_choice={"type": "function", "function": {"name": "record"}}, **GREEDY)
    assert response.choices[0].finish_reason == "tool_calls"
    arguments = json.loads(response.choices[0].message.tool_calls[0].function.arguments)
    # Required keys first, then at most the optional one: nothing unlisted.
    assert list(arguments)[:2] == ["name", "age"]
    assert set(arguments) <= {"name", "age", "note"}


def test_an_object_open_by_its_schema_stays_open(client: openai.OpenAI, model: str) -> None:
    schema = {**Person.model_json_schema(), "additionalProperties": True}
    response = client.chat.completions.create(
        model=model, messages=EXTRACT, max_tokens=ROOM,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": schema}}, **GREEDY)
    assert response.choices[0].finish_reason == "stop"
    person = json.loads(response.choices[0].message.content)
    assert list(person)[:2] == ["name", "age"] and len(person) > 2
