"""Tool round trips and structured output through the Messages and Responses APIs on the
real default model (SmolLM2-135M-Instruct): its template has no tool format, so tools go
through the server's generic format, and a forced call is the grammar's; the answer after
the tool result is the model's own text."""

from __future__ import annotations

from typing import Literal

import anthropic
import openai
import pytest
from pydantic import BaseModel, ConfigDict

from tests.server.support import API_KEY, ServerProcess


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: Literal["Paris", "Oslo", "Rome"]


QUESTION = "What is the weather in Paris?"
RESULT = "Sunny and 24 degrees Celsius in Paris."
DESCRIPTION = "The current weather in a city."
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def model(real_model_dir) -> str:
    return real_model_dir.name


@pytest.fixture(scope="module")
def claude(real_server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=real_server.url, api_key=API_KEY, max_retries=0)


def test_messages_tool_round_trip(claude: anthropic.Anthropic, model: str) -> None:
    tools = [{"name": "get_weather", "description": DESCRIPTION,
              "input_schema": City.model_json_schema()}]
    messages = [{"role": "user", "content": QUESTION}]
    called = claude.messages.create(model=model, max_tokens=40, tools=tools,
                                    tool_choice={"type": "any"}, messages=messages,
                                    extra_body=GREEDY)
    assert called.stop_reason == "tool_use"
    [use] = called.content
    assert use.name == "get_weather" and City.model_validate(use.input)
    messages += [
        {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": RESULT}]},
    ]
    answer = claude.messages.create(model=model, max_tokens=16, tools=tools,
                                    messages=messages, extra_body=GREEDY)
    [text] = answer.content
    assert text.type == "text" and text.text.strip()
    print("Messages answer after the tool result:", repr(text.text))


def test_messages_bash_tool_round_trip(claude: anthropic.Anthropic, model: str) -> None:
    """Anthropic's bash tool, declared by type and name only: a forced call's input is
    its documented schema's, and the command's output sent back gets an answer."""
    tools = [{"type": "bash_20250124", "name": "bash"}]
    messages = [{"role": "user", "content": "List the files in /tmp."}]
    called = claude.messages.create(model=model, max_tokens=60, tools=tools,
                                    tool_choice={"type": "tool", "name": "bash"},
                                    messages=messages, extra_body=GREEDY)
    assert called.stop_reason == "tool_use"
    [use] = called.content
    assert use.name == "bash" and use.input and set(use.input) <= {"command", "restart"}
    assert isinstance(use.input.get("command", ""), str)
    assert isinstance(use.input.get("restart", False), bool)
    messages += [
        {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "notes.txt\nreport.pdf"}]},
    ]
    answer = claude.messages.create(model=model, max_tokens=16, tools=tools,
                                    messages=messages, extra_body=GREEDY)
    assert answer.content[0].type == "text" and answer.content[0].text.strip()


def test_responses_tool_round_trip(real_client: openai.OpenAI, model: str) -> None:
    tools = [{"type": "function", "name": "get_weather", "description": DESCRIPTION,
              "parameters": City.model_json_schema(), "strict": True}]
    called = real_client.responses.create(model=model, input=QUESTION, tools=tools,
                                          tool_choice="required", max_output_tokens=40,
                                          temperature=0.0)
    [call] = called.output
    assert call.type == "function_call" and City.model_validate_json(call.arguments)
    answer = real_client.responses.create(
        model=model, previous_response_id=called.id, tools=tools, max_output_tokens=16,
        temperature=0.0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": RESULT}],
    )
    assert answer.output_text.strip()
    print("Responses answer after the tool result:", repr(answer.output_text))
    # The question and the call were the follow-up's prompt prefix.
    usage = answer.usage
    assert usage.input_tokens_details.cached_tokens >= called.usage.input_tokens


def test_responses_custom_tool_round_trip(real_client: openai.OpenAI, model: str) -> None:
    """A freeform custom tool, forced: the call's input is the model's text itself, and
    its output sent back continues the stored conversation from the cache."""
    tools = [{"type": "custom", "name": "write_note",
              "description": "Save a short note to the user's notebook."}]
    called = real_client.responses.create(
        model=model, input="Save a note saying: buy milk.", tools=tools,
        tool_choice={"type": "custom", "name": "write_note"}, max_output_tokens=60,
        temperature=0.0)
    [call] = called.output
    assert call.type == "custom_tool_call" and call.name == "write_note"
    assert "milk" in call.input and not call.input.startswith("{")
    answer = real_client.responses.create(
        model=model, previous_response_id=called.id, tools=tools, max_output_tokens=16,
        temperature=0.0,
        input=[{"type": "custom_tool_call_output", "call_id": call.call_id,
                "output": "Saved."}])
    assert answer.output_text.strip()
    usage = answer.usage
    assert usage.input_tokens_details.cached_tokens >= called.usage.input_tokens


def test_json_schema_through_both_apis(
    claude: anthropic.Anthropic, real_client: openai.OpenAI, model: str
) -> None:
    schema = City.model_json_schema()
    message = claude.messages.create(
        model=model, max_tokens=40, messages=[{"role": "user", "content": QUESTION}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    City.model_validate_json(message.content[0].text)
    parsed = real_client.responses.parse(model=model, input=QUESTION, text_format=City,
                                         max_output_tokens=40)
    assert isinstance(parsed.output_parsed, City)


def test_forced_and_free_tool_choice_share_the_whole_prompt(
    claude: anthropic.Anthropic, model: str
) -> None:
    """Agents force a tool on one request and not the next: the tool section the server
    writes into the system prompt does not change with it, so the second request reads
    its whole prompt from the cache (but the token the engine always computes again)."""
    tools = [{"name": "get_weather", "description": DESCRIPTION,
              "input_schema": City.model_json_schema()}]
    messages = [{"role": "user", "content": "Weather in Oslo, please."}]
    prompts = []
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "auto"},
                   {"type": "any"}):
        reply = claude.messages.create(model=model, max_tokens=1, tools=tools,
                                       tool_choice=choice, messages=messages,
                                       extra_body=GREEDY)
        prompts.append(reply.usage)
    first, *later = prompts
    for usage in later:
        prompt = usage.input_tokens + usage.cache_read_input_tokens
        assert prompt == first.input_tokens + first.cache_read_input_tokens
        assert usage.cache_read_input_tokens >= prompt - 1
