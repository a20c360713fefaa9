"""Structured output and forced tool calls through the OpenAI API, on the demo model.

Its random weights would never write valid JSON or a tool call by themselves, so every
parsed object and validating call here is the grammar's doing. The schemas keep to enums,
booleans and bounded integers, so a complete answer is a few tokens long whatever the
weights prefer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer

from server.openai.adapter import output_format
from server.openai.protocol import ChatCompletionRequest
from server.request import JsonObjectOutput
from tests.server.support import ServerProcess, model_variant, start_server


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: Literal["Paris", "Oslo"]
    days: int = Field(ge=1, le=7)
    sunny: bool


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather", "description": "The forecast for a city.",
        "parameters": Weather.model_json_schema(), "strict": True,
    },
}
CLOCK_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
MESSAGES = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
WEATHER_FORMAT = {"type": "json_schema", "json_schema": {
    "name": "weather", "strict": True, "schema": Weather.model_json_schema()}}
ROOM = 80  # max_tokens: a constrained answer here is far shorter


@pytest.fixture(scope="module")
def token_id(demo_model_dir):
    """The demo tokenizer's id of a one-token text, as logit_bias keys it."""
    tokenizer = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))

    def token_id(text: str) -> str:
        [token] = tokenizer.encode(text, add_special_tokens=False).ids
        return str(token)

    return token_id


def test_parse_with_a_pydantic_model(client: openai.OpenAI, model_id: str) -> None:
    completion = client.chat.completions.parse(
        model=model_id, messages=MESSAGES, response_format=Weather, max_tokens=ROOM,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Weather)


def test_parse_streamed(client: openai.OpenAI, model_id: str) -> None:
    with client.chat.completions.stream(
        model=model_id, messages=MESSAGES, response_format=Weather, max_tokens=ROOM,
    ) as stream:
        completion = stream.get_final_completion()
    assert isinstance(completion.choices[0].message.parsed, Weather)


def test_n_choices_and_logprobs_of_a_schema(client: openai.OpenAI, model_id: str) -> None:
    response = client.chat.completions.create(
        model=model_id, messages=MESSAGES, max_tokens=ROOM, n=2, seed=7, logprobs=True,
        response_format=WEATHER_FORMAT,
    )
    assert len(response.choices) == 2
    for choice in response.choices:
        Weather.model_validate_json(choice.message.content)
        # The logprobs are the answer's own tokens, as OpenAI reports them.
        assert "".join(token.token for token in choice.logprobs.content) == (
            choice.message.content
        )


def test_legacy_completions_take_a_response_format(
    client: openai.OpenAI, model_id: str
) -> None:
    response = client.completions.create(
        model=model_id, prompt="Weather in Paris:", max_tokens=ROOM,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {
            "name": "weather", "schema": Weather.model_json_schema()}}},
    )
    Weather.model_validate_json(response.choices[0].text)


def _calls(message) -> list[tuple[str, dict]]:
    return [(call.function.name, json.loads(call.function.arguments))
            for call in message.tool_calls or ()]


def test_a_named_function_is_called_with_valid_arguments(
    client: openai.OpenAI, model_id: str
) -> None:
    response = client.chat.completions.create(
        model=model_id, messages=MESSAGES, max_tokens=ROOM, tools=[CLOCK_TOOL, WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
    )
    message = response.choices[0].message
    [(name, arguments)] = _calls(message)
    assert name == "get_weather" and Weather.model_validate(arguments)
    assert message.tool_calls[0].id.startswith("call_")
    assert response.choices[0].finish_reason == "tool_calls"
    assert message.content is None


def test_a_forced_call_streams_its_name_then_its_arguments(
    client: openai.OpenAI, model_id: str
) -> None:
    chunks = list(client.chat.completions.create(
        model=model_id, messages=MESSAGES, max_tokens=ROOM, tools=[WEATHER_TOOL],
        tool_choice="required", parallel_tool_calls=False, stream=True,
    ))
    deltas = [call for chunk in chunks if chunk.choices
              for call in chunk.choices[0].delta.tool_calls or ()]
    first, *rest = deltas
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather" and first.function.arguments == ""
    assert rest and all(delta.id is None and delta.function.name is None for delta in rest)
    Weather.model_validate_json("".join(delta.function.arguments for delta in rest))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert chunks[0].choices[0].delta.role == "assistant"
    # null from the first chunk on, as the whole response gives it: no "" to add up
    assert all(chunk.choices[0].delta.content is None for chunk in chunks if chunk.choices)


@pytest.mark.parametrize("kind", [{}, {"type": ["object", "null"]}])
def test_a_forced_calls_arguments_are_an_object_whatever_type_its_schema_names(
    client: openai.OpenAI, model_id: str, kind: dict
) -> None:
    """A tool schema that names no type (MCP servers leave it out), or "object" among
    others, is an object's: the call's grammar used to take the schema as written, and
    the random weights wrote `true`, `null` or a number as arguments."""
    tool = {"type": "function", "function": {"name": "note", "parameters": {
        **kind, "properties": {"note": {"enum": ["a", "b"]}}, "additionalProperties": False}}}
    for seed in range(4):
        response = client.chat.completions.create(
            model=model_id, messages=MESSAGES, max_tokens=ROOM, tools=[tool],
            tool_choice="required", temperature=1, seed=seed)
        (call,) = response.choices[0].message.tool_calls
        assert isinstance(json.loads(call.function.arguments), dict), (seed, call)


def test_a_forced_call_cut_before_its_name_is_still_that_call(
    client: openai.OpenAI, model_id: str
) -> None:
    """max_tokens that ends a forced call within its marker or head: the call comes back
    with the function's name (never in doubt: the one tool_choice names, or the only
    tool where a call is required) and what arguments were written, none, as OpenAI's
    does; it used to come back as no call at all. Streamed, the same."""
    for tool_choice in ({"type": "function", "function": {"name": "get_weather"}},
                        "required"):
        a_forced_call_cut_before_its_name(client, model_id, tool_choice)


def a_forced_call_cut_before_its_name(client: openai.OpenAI, model_id: str,
                                      tool_choice: object) -> None:
    options = {"model": model_id, "messages": MESSAGES, "tools": [WEATHER_TOOL],
               "tool_choice": tool_choice}
    for max_tokens in range(1, 4):  # the marker and the head begun: no name yet
        choice = client.chat.completions.create(max_tokens=max_tokens, **options).choices[0]
        (call,) = choice.message.tool_calls
        assert (choice.finish_reason, call.function.name, call.function.arguments) == (
            "length", "get_weather", ""), max_tokens
        chunks = list(client.chat.completions.create(max_tokens=max_tokens, stream=True,
                                                     **options))
        names = [delta.function.name for chunk in chunks if chunk.choices
                 for delta in chunk.choices[0].delta.tool_calls or ()]
        assert names == ["get_weather"] and chunks[-1].choices[0].finish_reason == "length"


def test_tools_beside_a_schema_give_a_call_or_the_answer(
    client: openai.OpenAI, model_id: str, token_id
) -> None:
    """tool_choice auto with a response_format (the Agents SDK's agent with tools and an
    output_type): the reply is a call or the answer in the schema. The model is pushed
    toward the answer's `{` or the call tag's `<` to show both."""
    options = {"model": model_id, "messages": MESSAGES, "max_tokens": ROOM,
               "tools": [WEATHER_TOOL], "response_format": WEATHER_FORMAT,
               "parallel_tool_calls": False}  # pushed toward `<`, calls would go on
    answer = client.chat.completions.create(**options, logit_bias={token_id("{"): 100})
    message = answer.choices[0].message
    assert not message.tool_calls and Weather.model_validate_json(message.content)
    assert answer.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(
        **options, logit_bias={token_id("<"): 100}, stream=True))
    deltas = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or ()]
    assert deltas[0].function.name == "get_weather"
    Weather.model_validate_json("".join(delta.function.arguments for delta in deltas))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.fixture(scope="module")
def hermes_model(demo_model_dir, tmp_path_factory) -> Iterator[tuple[openai.OpenAI, str]]:
    """(a client, the model id) of a server on the demo model told that its tool format
    is Hermes/Qwen's (mlx-lm's json_tools), so its calls take the model-native path."""
    model = model_variant(demo_model_dir, tmp_path_factory.mktemp("hermes") / "tiny-hermes",
                          {"tokenizer_config.json": {"tool_parser_type": "json_tools"}})
    process = start_server(model, model.parent / "server.log")
    yield openai.OpenAI(base_url=f"{process.url}/v1", api_key="-", max_retries=0), model.name
    process.stop()


@pytest.mark.parametrize("tool_format", ["generic", "hermes"])
def test_parallel_tool_calls_unsaid_allows_more_calls_false_exactly_one(
    request: pytest.FixtureRequest, tool_format: str, token_id
) -> None:
    """OpenAI's default is true: a forced reply may go on to more calls. False: the
    grammar ends after one, however much the model would rather go on (its end-of-text
    tokens pushed down). In the generic format and in a model's own (whose newline
    between calls is not content)."""
    if tool_format == "generic":
        client, model = request.getfixturevalue("client"), request.getfixturevalue("model_id")
    else:
        client, model = request.getfixturevalue("hermes_model")
    no_end = {token_id(eos): -100 for eos in ("<|end_of_text|>", "<|im_end|>")}
    options = {"model": model, "messages": MESSAGES, "max_tokens": 3 * ROOM,
               "tools": [WEATHER_TOOL], "tool_choice": "required", "logit_bias": no_end}
    chunks = list(client.chat.completions.create(**options, stream=True))
    indexes = {call.index for chunk in chunks for call in chunk.choices[0].delta.tool_calls or ()}
    assert len(indexes) >= 2
    assert not any(chunk.choices[0].delta.content for chunk in chunks)
    one = client.chat.completions.create(**options, parallel_tool_calls=False).choices[0]
    [(name, arguments)] = _calls(one.message)
    assert name == "get_weather" and Weather.model_validate(arguments)
    assert one.finish_reason == "tool_calls"


def test_stop_strings_do_not_cut_a_forced_call(client: openai.OpenAI, model_id: str) -> None:
    # '"' occurs in every call; a stop string applied to it would leave broken JSON.
    response = client.chat.completions.create(
        model=model_id, messages=MESSAGES, max_tokens=ROOM, tools=[WEATHER_TOOL],
        tool_choice="required", parallel_tool_calls=False, stop=['"', "Paris"], n=2,
    )
    for choice in response.choices:
        [(name, arguments)] = _calls(choice.message)
        assert name == "get_weather" and Weather.model_validate(arguments)


def test_stop_token_ids_do_not_cut_a_schemas_answer(client: openai.OpenAI, model_id: str,
                                                     demo_model_dir) -> None:
    # The greedy answer's first token as a stop token id: applied, it left "" as a
    # finished ("stop") answer.
    options = {"model": model_id, "messages": MESSAGES, "max_tokens": ROOM, "temperature": 0,
               "response_format": WEATHER_FORMAT}
    answer = client.chat.completions.create(**options).choices[0].message.content
    tokenizer = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    first = tokenizer.encode(answer, add_special_tokens=False).ids[0]
    cut = client.chat.completions.create(**options, extra_body={"stop_token_ids": [first]})
    assert cut.choices[0].message.content == answer


def test_max_completion_tokens_bounds_the_answer(client: openai.OpenAI, model_id: str) -> None:
    # Greedy, so the answer does not depend on a draw. The grammar may still close the JSON
    # within the bound ("{}" is an object), so only the bound is asserted.
    response = client.chat.completions.create(
        model=model_id, messages=MESSAGES, max_completion_tokens=3, temperature=0,
        response_format={"type": "json_object"},
    )
    assert response.usage.completion_tokens <= 3
    # A call of one of two tools cut short before its name is complete is no call, and
    # no text either (of the only tool, it is that tool's call: the test above).
    other = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}}}}
    cut = client.chat.completions.create(
        model=model_id, messages=MESSAGES, max_completion_tokens=3,
        tools=[WEATHER_TOOL, other], tool_choice="required", temperature=0,
    ).choices[0]
    assert cut.finish_reason == "length"
    assert not cut.message.content and not cut.message.tool_calls


def test_an_unenforceable_schema_is_a_400_naming_the_keyword(
    client: openai.OpenAI, model_id: str
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=model_id, messages=MESSAGES, max_tokens=ROOM,
            response_format={"type": "json_schema", "json_schema": {
                "name": "tags", "strict": True,
                "schema": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
            }},
        )
    assert "uniqueItems" in raised.value.message
    assert raised.value.code == "unsupported_schema"
    assert raised.value.param == "response_format"


# Compiles and lets the first bytes through ('{"a": '), but the value of "a" is a
# $ref to itself: no JSON satisfies it, which only shows as the model writes it.
RUNS_DRY = {"type": "json_schema", "json_schema": {"name": "dry", "schema": {
    "type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"],
    "$defs": {"x": {"$ref": "#/$defs/x"}}}}}


def test_a_schema_that_runs_dry_mid_output_is_the_requests_error(
    client: openai.OpenAI, server: ServerProcess, headers: dict[str, str], model_id: str
) -> None:
    """A 400 (unsupported_schema), not the engine's 500; streamed, the error event after
    what was sent; the next request answers."""
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=ROOM,
                                       response_format=RUNS_DRY)
    assert (raised.value.code, raised.value.param) == ("unsupported_schema", "response_format")
    assert raised.value.message.endswith(
        "the output constraint cannot be met: "
        "nothing the grammar allows can follow the output so far"), "said once, no state dump"
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers=headers,
                      timeout=60, json={"model": model_id, "messages": MESSAGES,
                                        "max_tokens": ROOM, "stream": True,
                                        "response_format": RUNS_DRY}) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "unsupported_schema"
    answer = client.chat.completions.create(model=model_id, messages=MESSAGES,
                                            max_tokens=ROOM, response_format=WEATHER_FORMAT)
    assert Weather.model_validate_json(answer.choices[0].message.content)
    # A forced call whose arguments run dry names the tools.
    dry_tool = {"type": "function", "function": {
        "name": "dry", "parameters": RUNS_DRY["json_schema"]["schema"]}}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=ROOM,
                                       tools=[dry_tool], tool_choice="required")
    assert (raised.value.code, raised.value.param) == ("unsupported_schema", "tools")


def test_tool_results_render_for_the_generic_format(
    server: ServerProcess, headers: dict[str, str], model_id: str
) -> None:
    """mlx-lm knows no tool parser for the demo template (it renders tools itself, calls
    are read in the generic format): a whole tool round trip (offered tools, an earlier
    call, two results) renders and answers."""
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{i}", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
            for i, city in enumerate(["Paris", "Oslo"])]},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ]
    response = httpx.post(f"{server.url}/v1/chat/completions", headers=headers, timeout=60, json={
        "model": model_id, "messages": messages, "tools": [WEATHER_TOOL], "max_tokens": 2})
    assert response.status_code == 200, response.text


# Other servers' grammar fields, honoured as those servers do: (field, value, what the
# reply must be). The demo model's random weights write none of these by themselves.
GBNF_ANSWER = 'root ::= ("yes" | "no") ", " [0-9] [0-9]? "%"'
LARK_ANSWER = 'start: ("yes" | "no") ", " /[0-9]{1,2}/ "%"'
ANSWER = r"(yes|no), [0-9]{1,2}%"
FOREIGN_GRAMMARS = [
    ("guided_choice", ["north", "south"], "north|south"),  # vLLM
    ("guided_regex", ANSWER, ANSWER),
    ("guided_grammar", LARK_ANSWER, ANSWER),
    ("guided_grammar", GBNF_ANSWER, ANSWER),
    ("grammar", GBNF_ANSWER, ANSWER),  # llama.cpp
    ("regex", ANSWER, ANSWER),  # SGLang
    ("ebnf", GBNF_ANSWER, ANSWER),
    ("structured_outputs", {"choice": ["north", "south"]}, "north|south"),  # vLLM's newer
    ("structured_outputs", {"regex": ANSWER}, ANSWER),
    ("structured_outputs", {"grammar": LARK_ANSWER}, ANSWER),
]


@pytest.mark.parametrize(("field", "value", "reply"), FOREIGN_GRAMMARS)
def test_other_servers_grammar_fields_bind_the_reply(
    client: openai.OpenAI, model_id: str, field: str, value: object, reply: str
) -> None:
    response = client.chat.completions.create(
        model=model_id, messages=MESSAGES, max_tokens=ROOM, extra_body={field: value})
    assert re.fullmatch(reply, response.choices[0].message.content)
    assert response.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(("field", "value"), [
    ("guided_json", Weather.model_json_schema()),  # vLLM: the schema
    ("guided_json", json.dumps(Weather.model_json_schema())),  # or its text
    ("json_schema", Weather.model_json_schema()),  # llama.cpp
    ("json_schema", json.dumps(Weather.model_json_schema())),  # SGLang
    ("structured_outputs", {"json": Weather.model_json_schema()}),
])
def test_other_servers_json_schema_fields_bind_the_reply(
    client: openai.OpenAI, model_id: str, field: str, value: object
) -> None:
    response = client.chat.completions.create(
        model=model_id, messages=MESSAGES, max_tokens=ROOM, extra_body={field: value})
    Weather.model_validate_json(response.choices[0].message.content)


def test_a_grammar_field_binds_streamed_and_legacy_completions(
    client: openai.OpenAI, model_id: str
) -> None:
    chunks = client.completions.create(model=model_id, prompt="Which way?", max_tokens=ROOM,
                                       stream=True, extra_body={"guided_choice": ["up", "down"]})
    assert "".join(chunk.choices[0].text for chunk in chunks) in ("up", "down")
    answer = client.completions.create(
        model=model_id, prompt="Weather:", max_tokens=ROOM,
        extra_body={"structured_outputs": {"json": Weather.model_json_schema()}})
    Weather.model_validate_json(answer.choices[0].text)


def test_vllms_json_object_is_openais() -> None:
    body = ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "structured_outputs": {"json_object": True}})
    assert output_format(body) == JsonObjectOutput()


def test_a_grammars_text_is_not_read_as_json(client: openai.OpenAI, model_id: str) -> None:
    """A JSON answer never repeats a key, token by token (engine/json_keys.py); text in a
    grammar of its own says what the grammar says, a key written twice too."""
    response = client.chat.completions.create(
        model=model_id, messages=MESSAGES, max_tokens=ROOM,
        extra_body={"guided_regex": r'\{"a": 1, "a": 2\}'})
    assert response.choices[0].message.content == '{"a": 1, "a": 2}'


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"guided_regex": "a", "regex": "b"}, "regex", "invalid_request"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice",
     "invalid_request"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "invalid_request"),
    ({"guided_json": "{not json"}, "guided_json", "invalid_request"),
    ({"guided_choice": []}, "guided_choice", "invalid_request"),
    ({"guided_regex": "[0-9"}, "guided_regex", "unsupported_grammar"),
    ({"grammar": "root ::= ((("}, "grammar", "unsupported_grammar"),
    ({"guided_choice": ["a"], "tools": [WEATHER_TOOL]}, "guided_choice", "invalid_request"),
    ({"structural_tag": {"begin": "<f>"}}, "structural_tag", "invalid_request"),
])
def test_a_grammar_field_that_cannot_bind_is_a_400_naming_it(
    client: openai.OpenAI, model_id: str, body: dict, param: str, code: str
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=ROOM,
                                       extra_body=body)
    assert (raised.value.param, raised.value.code) == (param, code)
