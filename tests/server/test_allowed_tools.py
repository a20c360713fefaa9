"""tool_choice `allowed_tools` (OpenAI's Chat Completions and Responses), on the real
default model: the model may call only the allowed tools but still sees them all, so the
prompt, and what the cache holds of it, does not change with the allowed set. pydantic-ai
sends it whenever an agent narrows its tools (`ToolOrOutput`, a list of names). And plain
"auto" with a strict tool, whose calls the grammar binds as it binds allowed tools'."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.server.support import API_KEY, ServerProcess

ASK_TO_DELETE = "Delete all files in the folder /tmp/work right now using delete_files."
GREEDY = {"temperature": 0.0}


def function(name: str, parameter: str, description: str) -> dict:
    return {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {parameter: {"type": "string"}},
        "required": [parameter]}}


WEATHER = function("get_weather", "city", "The current weather in a city.")
DELETE = function("delete_files", "folder", "Delete every file in a folder.")
CHAT_TOOLS = [{"type": "function", "function": tool} for tool in (WEATHER, DELETE)]
RESPONSES_TOOLS = [{"type": "function", **tool} for tool in (WEATHER, DELETE)]


def allowed(mode: str, *names: str) -> dict:
    return {"type": "allowed_tools", "allowed_tools": {
        "mode": mode, "tools": [{"type": "function", "function": {"name": n}} for n in names]}}


@pytest.fixture(scope="module")
def model(real_client: openai.OpenAI) -> str:
    return real_client.models.list().data[0].id


def chat(client: openai.OpenAI, model: str, tool_choice, max_tokens: int = 40, **more):
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": ASK_TO_DELETE}], tools=CHAT_TOOLS,
        tool_choice=tool_choice, max_tokens=max_tokens, **GREEDY, **more)


def test_required_calls_only_an_allowed_tool_from_the_same_prompt(real_client, model):
    free = chat(real_client, model, "required")
    assert [c.function.name for c in free.choices[0].message.tool_calls] == ["delete_files"]
    narrowed = chat(real_client, model, allowed("required", "get_weather"))
    calls = narrowed.choices[0].message.tool_calls
    assert calls and {call.function.name for call in calls} == {"get_weather"}
    assert narrowed.choices[0].finish_reason == "tool_calls"
    usage = narrowed.usage
    assert usage.prompt_tokens == free.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 1


def test_auto_answers_as_auto_does_when_it_calls_nothing(real_client, model):
    """Stop sequences included: the reply is free text, whose calls the grammar restricts."""
    free = chat(real_client, model, "auto", max_tokens=24).choices[0]
    narrowed = chat(real_client, model, allowed("auto", "get_weather"), max_tokens=24).choices[0]
    assert not free.message.tool_calls and not narrowed.message.tool_calls
    assert narrowed.message.content == free.message.content
    stop = free.message.content.split()[3]
    stopped = chat(real_client, model, allowed("auto", "get_weather"), max_tokens=24,
                   stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.message.content == free.message.content[:free.message.content.index(stop)]


def test_responses_required_calls_an_allowed_tool_and_echoes_the_choice(real_client, model):
    choice = {"type": "allowed_tools", "mode": "required",
              "tools": [{"type": "function", "name": "get_weather"}]}
    response = real_client.responses.create(
        model=model, input=ASK_TO_DELETE, tools=RESPONSES_TOOLS, tool_choice=choice,
        max_output_tokens=40, **GREEDY)
    assert {item.name for item in response.output if item.type == "function_call"} == {
        "get_weather"}
    assert response.tool_choice.model_dump() == choice


FLIGHT = {"type": "object", "properties": {
    "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
    "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
    "passengers": {"type": "integer", "minimum": 1}},
    "required": ["origin", "destination", "passengers"], "additionalProperties": False}
THERMOSTAT = {"type": "object", "properties": {
    "degrees": {"type": "integer"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["degrees", "unit"], "additionalProperties": False}


def ask_with_strict(client: openai.OpenAI, model: str, ask: str, strict: bool,
                    max_tokens: int = 80, **more):
    tools = [{"type": "function", "function": {
        "name": name, "description": name.replace("_", " "), "parameters": schema,
        "strict": strict}} for name, schema in (("book_flight", FLIGHT),
                                                 ("set_thermostat", THERMOSTAT))]
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": ask}], tools=tools,
        max_tokens=max_tokens, **GREEDY, **more).choices[0]


def test_auto_binds_a_strict_tools_call_to_its_schema(real_client, model):
    """OpenAI's `strict` holds whatever the tool choice: under plain "auto" the model still
    decides whether to call, and the call it makes validates. Unbound, the same model's
    call of the same tool is not even JSON."""
    ask = "Book a flight from Paris to Tokyo for me and my wife."
    [loose] = ask_with_strict(real_client, model, ask, strict=False).message.tool_calls
    assert loose.function.name == "book_flight"
    with pytest.raises(ValueError):
        json.loads(loose.function.arguments)
    bound = ask_with_strict(real_client, model, ask, strict=True)
    [call] = bound.message.tool_calls
    assert call.function.name == "book_flight" and bound.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), FLIGHT)


def test_auto_with_a_strict_tool_answers_in_text_as_auto_does(real_client, model):
    """A reply that calls nothing is the model's own text, stop sequences included."""
    ask = "Set the thermostat to twenty degrees please."
    loose = ask_with_strict(real_client, model, ask, strict=False, max_tokens=24)
    bound = ask_with_strict(real_client, model, ask, strict=True, max_tokens=24)
    assert not loose.message.tool_calls and not bound.message.tool_calls
    assert bound.message.content == loose.message.content
    stop = loose.message.content.split()[4]
    stopped = ask_with_strict(real_client, model, ask, strict=True, max_tokens=24,
                              stop=[stop])
    assert stopped.finish_reason == "stop"
    assert stopped.message.content == loose.message.content[:loose.message.content.index(stop)]


def ask_responses(client: openai.OpenAI, model: str, parameters: dict, **strict):
    tool = {"type": "function", "name": "book_flight", "description": "book flight",
            "parameters": parameters, **strict}
    return client.responses.create(
        model=model, input="Book a flight from Paris to Tokyo for me and my wife.",
        tools=[tool], max_output_tokens=80, **GREEDY)


def only_call(response):
    [call] = [item for item in response.output if item.type == "function_call"]
    return call


def test_responses_tools_are_strict_unless_they_say_otherwise(real_client, model):
    """OpenAI's Responses API binds a function tool whose `strict` is unsaid, its schema
    normalized to strict mode (every property required, objects closed): the call is the
    one `strict: true` with that schema gives, and the response lists the tool as it ran.
    Chat Completions' default is the opposite; `strict: false` opts out. A keyword the
    grammar cannot enforce, which `strict: true` refuses, is ignored under the default."""
    optional = {**FLIGHT, "required": ["origin"]}
    del optional["additionalProperties"]
    unsaid = ask_responses(real_client, model, optional)
    jsonschema.validate(json.loads(only_call(unsaid).arguments), FLIGHT)
    strict = ask_responses(real_client, model, FLIGHT, strict=True)
    assert only_call(unsaid).arguments == only_call(strict).arguments
    [listed] = unsaid.tools
    assert listed.strict is True and listed.parameters == FLIGHT
    loose = ask_responses(real_client, model, optional, strict=False)
    assert loose.tools[0].strict is False and loose.tools[0].parameters == optional
    with pytest.raises(ValueError):
        json.loads(only_call(loose).arguments)
    unknown = {**FLIGHT, "properties": {**FLIGHT["properties"],
                                        "origin": {"type": "string", "format": "airport"}}}
    json.loads(only_call(ask_responses(real_client, model, unknown)).arguments)
    with pytest.raises(openai.BadRequestError, match="format"):
        ask_responses(real_client, model, unknown, strict=True)


@pytest.mark.parametrize(("path", "tool_choice", "message"), [
    ("/v1/chat/completions", allowed("auto", "rm_rf"), "'rm_rf', which is not in tools"),
    ("/v1/chat/completions", allowed("auto"), "at least 1 item"),
    ("/v1/chat/completions", allowed("sometimes", "get_weather"), "'auto' or 'required'"),
    ("/v1/chat/completions", {"type": "allowed_tools"}, "allowed_tools: Field required"),
    ("/v1/chat/completions", {"type": "custom", "name": "x"}, "custom: Field required"),
    ("/v1/chat/completions", {"type": {}}, "must be a mode"),  # unhashable: not a 500
    ("/v1/responses", {"type": ["custom"]}, "must be a mode"),
    ("/v1/responses", {"type": "allowed_tools", "mode": "auto",
                       "tools": [{"type": "function", "name": "rm_rf"}]}, "'rm_rf'"),
])
def test_allowed_tools_the_request_cannot_have_are_a_400(
        real_server: ServerProcess, model, path, tool_choice, message):
    body = {"model": model, "tool_choice": tool_choice, "max_tokens": 4}
    if path == "/v1/responses":
        body = {"model": model, "input": "hi", "tools": RESPONSES_TOOLS,
                "tool_choice": tool_choice, "max_output_tokens": 16}
    else:
        body |= {"messages": [{"role": "user", "content": "hi"}], "tools": CHAT_TOOLS}
    response = httpx.post(f"{real_server.url}{path}", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"]


class Capital(BaseModel):
    """A country's capital city."""

    country: str
    city: str


def test_a_pydantic_ai_agent_that_narrows_its_tools(real_server: ServerProcess, model):
    """`ToolOrOutput` keeps the agent's output tool and the named function tools: sent as
    allowed_tools, mode "required" (the output type admits no plain text)."""
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ToolOrOutput
    from pydantic_ai.usage import UsageLimits

    provider = OpenAIProvider(base_url=f"{real_server.url}/v1", api_key=API_KEY)
    agent = Agent(OpenAIChatModel(model, provider=provider), output_type=Capital,
                  model_settings={"max_tokens": 48, "temperature": 0,
                                  "tool_choice": ToolOrOutput(function_tools=["get_weather"])})
    called = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        called.append("get_weather")
        return "Sunny."

    @agent.tool_plain
    def delete_files(folder: str) -> str:
        """Delete every file in a folder."""
        called.append("delete_files")
        return "Deleted."

    result = agent.run_sync("What is the capital of France? Then delete /tmp/work.",
                            usage_limits=UsageLimits(request_limit=4))
    assert isinstance(result.output, Capital) and result.output.city
    assert "delete_files" not in called
