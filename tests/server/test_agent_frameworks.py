"""What agent frameworks send, with their own clients, against the real default model.

The calls agents make: the OpenAI SDK's `chat.completions.parse`, LangChain's
`with_structured_output` (json_schema by default, function_calling, json_mode),
pydantic-ai agents with an `output_type` (a forced output tool), OpenAI Agents SDK
agents with `tool_choice="required"` and agents with tools and an `output_type` (tools
beside a response_format), each whole and streamed, each ending in a parsed object or a
tool call that validates. SmolLM2-135M's template has no tool format, so the tool calls
go through the generic format; the grammar makes them valid.

One server for the module, short answers (the model decodes ~14 tok/s on 2 CPU cores).
"""

from __future__ import annotations

import asyncio

import openai
import pytest
from pydantic import BaseModel

from tests.server.support import API_KEY, ServerProcess

MAX_TOKENS = 48
QUESTION = "What is the capital of France?"


class Capital(BaseModel):
    """A country's capital city."""

    country: str
    city: str


def _checked(capital: Capital) -> Capital:
    assert isinstance(capital, Capital) and capital.city and capital.country
    return capital


@pytest.fixture(scope="module")
def base_url(real_server: ServerProcess) -> str:
    return f"{real_server.url}/v1"


@pytest.fixture(scope="module")
def model_name(real_client: openai.OpenAI) -> str:
    return real_client.models.list().data[0].id


# -- the OpenAI SDK ------------------------------------------------------------------------


def test_sdk_parse(real_client: openai.OpenAI, model_name: str) -> None:
    completion = real_client.chat.completions.parse(
        model=model_name, messages=[{"role": "user", "content": QUESTION}],
        response_format=Capital, max_tokens=MAX_TOKENS, temperature=0,
    )
    _checked(completion.choices[0].message.parsed)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_sdk_tools_beside_a_response_format(
    real_client: openai.OpenAI, model_name: str, stream: bool
) -> None:
    """The reply is a call that validates or the answer in the schema (greedy, this model
    calls the tool)."""
    options = {"model": model_name, "messages": [{"role": "user", "content": QUESTION}],
               "tools": [openai.pydantic_function_tool(Capital, name="record_capital")],
               "response_format": Capital, "max_tokens": MAX_TOKENS, "temperature": 0}
    if stream:
        with real_client.chat.completions.stream(**options) as events:
            message = events.get_final_completion().choices[0].message
    else:
        message = real_client.chat.completions.parse(**options).choices[0].message
    calls = message.tool_calls or []
    assert calls or _checked(message.parsed)
    for call in calls:
        _checked(call.function.parsed_arguments)


def test_sdk_parse_streamed(real_client: openai.OpenAI, model_name: str) -> None:
    with real_client.chat.completions.stream(
        model=model_name, messages=[{"role": "user", "content": QUESTION}],
        response_format=Capital, max_tokens=MAX_TOKENS, temperature=0,
    ) as stream:
        _checked(stream.get_final_completion().choices[0].message.parsed)


# -- LangChain -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(base_url: str, model_name: str):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=model_name, base_url=base_url, api_key=API_KEY,
                      max_tokens=MAX_TOKENS, temperature=0, max_retries=0)


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_langchain_with_structured_output(chat_model, method: str, stream: bool) -> None:
    structured = chat_model.with_structured_output(Capital, method=method)
    # json_mode only promises some JSON object: the prompt has to ask for the keys.
    prompt = QUESTION if method != "json_mode" else (
        f'{QUESTION} Reply in JSON like {{"country": "...", "city": "..."}}.')
    if stream:
        *_, result = structured.stream(prompt)
    else:
        result = structured.invoke(prompt)
    _checked(result)


# -- pydantic-ai ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pydantic_agent(base_url: str, model_name: str):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(model_name, provider=OpenAIProvider(base_url=base_url,
                                                                  api_key=API_KEY))
    return Agent(model, output_type=Capital,
                 model_settings={"max_tokens": MAX_TOKENS, "temperature": 0})


def test_pydantic_ai_output_type(pydantic_agent) -> None:
    _checked(pydantic_agent.run_sync(QUESTION).output)


def test_pydantic_ai_output_type_streamed(pydantic_agent) -> None:
    async def run() -> Capital:
        async with pydantic_agent.run_stream(QUESTION) as result:
            return await result.get_output()

    _checked(asyncio.run(run()))


# -- the OpenAI Agents SDK -----------------------------------------------------------------


def _run_agent(base_url: str, model_name: str, stream: bool, max_turns: int,
               **agent_options) -> tuple[object, list[Capital]]:
    """An Agents SDK agent with a `record_capital` tool, run on the question: (its final
    output, None if it ran out of turns; the calls its tool received)."""
    from agents import (
        Agent,
        MaxTurnsExceeded,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # no trace upload: nothing outside this machine
    calls: list[Capital] = []

    @function_tool
    def record_capital(country: str, city: str) -> str:
        """Record a country's capital city."""
        calls.append(Capital(country=country, city=city))
        return "recorded"

    async def run() -> object:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0)
        agent = Agent(
            name="geographer", tools=[record_capital],
            model=OpenAIChatCompletionsModel(model=model_name, openai_client=client),
            **agent_options,
        )
        try:
            if not stream:
                return (await Runner.run(agent, QUESTION, max_turns=max_turns)).final_output
            result = Runner.run_streamed(agent, QUESTION, max_turns=max_turns)
            async for _ in result.stream_events():
                pass
            return result.final_output
        except MaxTurnsExceeded:
            return None

    return asyncio.run(run()), calls


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_agents_sdk_required_tool_choice(base_url: str, model_name: str, stream: bool) -> None:
    from agents import ModelSettings

    final_output, calls = _run_agent(
        base_url, model_name, stream, max_turns=2,
        instructions="Record the capital the user asks about.",
        tool_use_behavior="stop_on_first_tool",
        model_settings=ModelSettings(tool_choice="required", max_tokens=MAX_TOKENS,
                                     temperature=0),
    )
    assert final_output == "recorded"
    [capital] = calls
    _checked(capital)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_agents_sdk_tools_and_output_type(base_url: str, model_name: str, stream: bool) -> None:
    """An agent with tools and an `output_type` sends both, tool_choice unsaid: each turn
    is a call or the final output. Greedy, this model calls its tool (and would again
    after every result), so one turn ends the run: the call made (the SDK validates the
    arguments before it calls) or the final output parsed."""
    from agents import ModelSettings

    final_output, calls = _run_agent(
        base_url, model_name, stream, max_turns=1,
        instructions="Record the capital, then answer.", output_type=Capital,
        model_settings=ModelSettings(max_tokens=MAX_TOKENS, temperature=0),
    )
    assert calls or final_output is not None
    for capital in calls:
        _checked(capital)
    if final_output is not None:
        _checked(final_output)
