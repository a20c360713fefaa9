"""A reasoning model through the OpenAI API: thinking goes to `reasoning_content`, never
into `content`; `enable_thinking` reaches the template; a schema constrains only the
answer after the thinking; and the radix cache still serves the next turn when the
template drops the earlier turn's thinking."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.support import ServerProcess
from tests.server.thinking_model import THINK_END

NO_EOS = {"ignore_eos": True}
# Long enough that the shared part dominates the second turn, as in an agent's chat.
SYSTEM = "You are a careful assistant. " + " ".join(
    f"Rule {i}: answer plainly and check the facts twice." for i in range(20)
)


@pytest.fixture(scope="module")
def client(thinking_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{thinking_server.url}/v1", api_key="-", max_retries=0)


def _messages(question: str = "Which city is the capital of France?") -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_thinking_is_reasoning_content_never_content(client: openai.OpenAI) -> None:
    # The template opens the thinking block; the random weights never close it.
    options = {"model": "tiny-thinking", "messages": _messages(), "max_tokens": 6,
               "temperature": 0, "extra_body": NO_EOS}
    response = client.chat.completions.create(**options)
    message = response.choices[0].message
    assert message.content == "" and message.reasoning_content
    assert response.usage.completion_tokens_details.reasoning_tokens == 6
    chunks = list(client.chat.completions.create(**options, stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert not any(delta.content for delta in deltas)
    streamed = "".join(getattr(delta, "reasoning_content", None) or "" for delta in deltas)
    assert streamed == message.reasoning_content


def test_enable_thinking_reaches_the_template(client: openai.OpenAI) -> None:
    def run(**kwargs):
        return client.chat.completions.create(
            model="tiny-thinking", messages=_messages(), max_tokens=4, temperature=0,
            extra_body={**NO_EOS, **kwargs},
        )

    thinking, plain = run(), run(chat_template_kwargs={"enable_thinking": False})
    # The template closes the block itself: the answer is content, with no reasoning.
    assert plain.usage.prompt_tokens > thinking.usage.prompt_tokens
    assert plain.choices[0].message.content
    assert plain.choices[0].message.reasoning_content is None


def test_the_cache_serves_the_next_turn_when_thinking_is_dropped(
    client: openai.OpenAI,
) -> None:
    first = client.chat.completions.create(
        model="tiny-thinking", messages=_messages(), max_tokens=8, temperature=0,
        extra_body=NO_EOS,
    )
    reply = first.choices[0].message
    turn_two = [
        *_messages(),
        {"role": "assistant", "content": "Paris.", "reasoning_content": reply.reasoning_content},
        {"role": "user", "content": "And of Norway?"},
    ]
    second = client.chat.completions.create(
        model="tiny-thinking", messages=turn_two, max_tokens=2, extra_body=NO_EOS,
    )
    usage = second.usage
    cached = usage.prompt_tokens_details.cached_tokens
    # Turn one's prompt up to its generation prompt's "<think>\n" (2 tokens) is shared.
    assert cached >= first.usage.prompt_tokens - 2
    print(f"turn 2: {cached}/{usage.prompt_tokens} prompt tokens cached "
          f"({cached / usage.prompt_tokens:.0%})")


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_constrains_only_the_answer_after_thinking(
    client: openai.OpenAI, stream: bool
) -> None:
    """The end-of-thinking marker is pushed to be the first token: a grammar applied from
    the first token would forbid it, so seeing it in the count proves the grammar waited."""
    think_end = 2049  # the marker's token id in the thinking model
    schema = {"type": "object", "additionalProperties": False, "required": ["capital"],
              "properties": {"capital": {"enum": ["Paris", "Oslo"]}}}
    options = {
        "model": "tiny-thinking", "messages": _messages(), "max_tokens": 40,
        "logit_bias": {str(think_end): 100}, "logprobs": True,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "capital", "schema": schema}},
    }
    if stream:
        chunks = list(client.chat.completions.create(
            **options, stream=True, stream_options={"include_usage": True}))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        scored = [token for c in chunks if c.choices and c.choices[0].logprobs
                  for token in c.choices[0].logprobs.content]
        usage = chunks[-1].usage
    else:
        response = client.chat.completions.create(**options)
        content, usage = response.choices[0].message.content, response.usage
        scored = response.choices[0].logprobs.content
    assert THINK_END not in content
    assert json.loads(content)["capital"] in ("Paris", "Oslo")
    # Every answer token is scored; the one more generated token is the marker.
    assert usage.completion_tokens == len(scored) + 1
