"""How long a reply may be when its request sets no limit, or one past the context: the
agent APIs (Responses, Messages) take their limits as caps under the server's
`max_output_tokens` and the context window, and a reply cut short says so on the item it
was writing. The tiny demo model (random weights) never ends a greedy reply on its own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from engine.demo_model import MAX_POSITION_EMBEDDINGS
from tests.server.support import ServerProcess, start_server

CAP = 600
GREEDY = {"temperature": 0.0}
WEATHER = {"type": "function", "name": "get_weather", "description": "The forecast.",
           "parameters": {"type": "object",
                          "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def capped(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    log_path = tmp_path_factory.mktemp("capped") / "server.log"
    process = start_server(demo_model_dir, log_path, "--max-output-tokens", str(CAP))
    yield process
    process.stop()


def test_the_server_cap_bounds_every_apis_reply_without_a_limit_of_its_own(
    capped: ServerProcess, model_id: str
) -> None:
    """Open WebUI and most chat front ends send no max_tokens: OpenAI's, Ollama's and LM
    Studio's replies then run to the end of the context window, and so do ours, short of
    the server's cap (a 512-token default cut long answers and code edits short)."""
    openai_client = openai.OpenAI(base_url=f"{capped.url}/v1", api_key="-", max_retries=0)
    for limit in ({}, {"max_output_tokens": 10 * CAP}):
        response = openai_client.responses.create(model=model_id, input="Go on.", **limit,
                                                  **GREEDY)
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
        assert response.usage.output_tokens == CAP
        assert response.output[-1].status == "incomplete"
    claude = anthropic.Anthropic(base_url=capped.url, api_key="-", max_retries=0)
    message = claude.messages.create(model=model_id, max_tokens=CAP + 1, extra_body=GREEDY,
                                     messages=[{"role": "user", "content": "Go on."}])
    assert (message.stop_reason, message.usage.output_tokens) == ("max_tokens", CAP)
    chat = openai_client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Go on."}], **GREEDY)
    assert chat.usage.completion_tokens == CAP
    assert chat.choices[0].finish_reason == "length"


def test_a_response_without_max_output_tokens_may_fill_the_context(
    client: openai.OpenAI, model_id: str
) -> None:
    """OpenAI's default: the rest of the context window (short of it here, to be quick)."""
    def count(repeats: int) -> int:
        response = client.responses.create(model=model_id, input="Go on. " * repeats + "?",
                                           max_output_tokens=16)
        return response.usage.input_tokens

    per_repeat = count(2) - count(1)
    repeats = (MAX_POSITION_EMBEDDINGS - 700 - count(0)) // per_repeat
    response = client.responses.create(model=model_id, input="Go on. " * repeats + "?",
                                       **GREEDY)
    assert response.status == "incomplete"
    assert response.usage.input_tokens + response.usage.output_tokens == MAX_POSITION_EMBEDDINGS
    assert response.usage.output_tokens > 512


def test_a_call_cut_short_is_incomplete_streamed_and_whole(
    client: openai.OpenAI, model_id: str
) -> None:
    forced = {"model": model_id, "input": "Weather in Oslo?", "tools": [WEATHER],
              "tool_choice": {"type": "function", "name": "get_weather"}, **GREEDY}
    whole = client.responses.create(**forced, max_output_tokens=80)
    assert whole.status == "completed" and whole.output[-1].status == "completed"
    cut = {**forced, "max_output_tokens": whole.usage.output_tokens - 2}
    response = client.responses.create(**cut)
    [call] = response.output
    assert (response.status, call.type, call.status) == ("incomplete", "function_call",
                                                         "incomplete")
    with client.responses.stream(**cut) as stream:
        events = list(stream)
    [done] = [event for event in events if event.type == "response.output_item.done"]
    assert done.item.status == "incomplete" and done.item.arguments == call.arguments
    assert events[-1].type == "response.incomplete"
    claude_stop = anthropic.Anthropic(base_url=str(client.base_url).removesuffix("/v1/"),
                                      api_key=client.api_key, max_retries=0)
    message = claude_stop.messages.create(
        model=model_id, max_tokens=cut["max_output_tokens"], extra_body=GREEDY,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[{"name": "get_weather", "input_schema": WEATHER["parameters"]}],
        tool_choice={"type": "tool", "name": "get_weather"})
    assert message.stop_reason == "max_tokens"  # not tool_use: the call is unfinished
