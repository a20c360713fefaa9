"""What client libraries send, on the real default model (SmolLM2-135M-Instruct):
instructor's structured extraction, whose pydantic schemas leave objects open, an
assistant prefill through the Anthropic SDK and vLLM's chat fields, and the scoring
requests of lm-evaluation-harness (echo with prompt logprobs)."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import instructor
import mlx.core as mx
import mlx_lm
import openai
import pytest
from mistralai.client import Mistral
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


# -- assistant prefill -------------------------------------------------------------------

CAPITAL = [{"role": "user", "content": "What is the capital of France? Answer in JSON."},
           {"role": "assistant", "content": '{"capital": "'}]
PREFILL_TOKENS = 8


@pytest.fixture(scope="module")
def reference(real_model_dir: Path):
    """mlx-lm itself on the same directory: greedy text after a prompt given as token ids."""
    model, tokenizer = mlx_lm.load(str(real_model_dir))

    def greedy(prompt: list[int], max_tokens: int) -> str:
        tokens = [response.token for response in mlx_lm.stream_generate(
            model, tokenizer, prompt, max_tokens=max_tokens)]
        return tokenizer.decode([t for t in tokens if t not in tokenizer.eos_token_ids])

    greedy.tokenizer = tokenizer
    greedy.model = model
    return greedy


def test_anthropic_continues_a_final_assistant_message(real_server: ServerProcess,
                                                       model: str, reference) -> None:
    """The reply is the continuation only, equal to mlx-lm continuing the same rendering;
    asked again, the prompt comes from the cache."""
    prompt = reference.tokenizer.apply_chat_template(CAPITAL, continue_final_message=True)
    expected = reference(prompt, PREFILL_TOKENS)
    assert expected.startswith("Paris")
    claude = anthropic.Anthropic(base_url=real_server.url, api_key=API_KEY, max_retries=0)
    replies = [claude.messages.create(model=model, max_tokens=PREFILL_TOKENS, messages=CAPITAL,
                                      extra_body=GREEDY) for _ in range(2)]
    for reply in replies:
        assert reply.content[0].text == expected
    assert replies[0].usage.input_tokens + replies[0].usage.cache_read_input_tokens == len(
        prompt)
    assert replies[1].usage.cache_read_input_tokens >= len(prompt) - 1


def test_an_empty_final_assistant_message_asks_for_a_plain_reply(real_server: ServerProcess,
                                                                 model: str) -> None:
    claude = anthropic.Anthropic(base_url=real_server.url, api_key=API_KEY, max_retries=0)
    question = CAPITAL[:1]
    plain, empty = (claude.messages.create(model=model, max_tokens=4, messages=messages,
                                           extra_body=GREEDY)
                    for messages in (question, [*question, {"role": "assistant",
                                                            "content": ""}]))
    assert empty.content[0].text == plain.content[0].text


def test_openai_chat_honours_vllms_prefill_fields(real_server: ServerProcess,
                                                  model: str, reference) -> None:
    prompt = reference.tokenizer.apply_chat_template(CAPITAL, continue_final_message=True)
    closed = reference.tokenizer.apply_chat_template(CAPITAL, add_generation_prompt=False)
    with httpx.Client(base_url=real_server.url, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        def chat(**fields) -> httpx.Response:
            return client.post("/v1/chat/completions", json={
                "model": model, "messages": CAPITAL, "max_tokens": PREFILL_TOKENS,
                "temperature": 0, **fields})

        continued = chat(continue_final_message=True, add_generation_prompt=False).json()
        as_is = chat(add_generation_prompt=False).json()
        both = chat(continue_final_message=True)
        empty = client.post("/v1/chat/completions", json={
            "model": model, "max_tokens": 1, "continue_final_message": True,
            "add_generation_prompt": False,
            "messages": [*CAPITAL[:1], {"role": "assistant", "content": " "}]})
    assert continued["choices"][0]["message"]["content"] == reference(prompt, PREFILL_TOKENS)
    assert continued["usage"]["prompt_tokens"] == len(prompt)
    # The Anthropic test's prompt, or this module's first request of it, is cached.
    assert continued["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prompt) - 1
    assert as_is["usage"]["prompt_tokens"] == len(closed)
    assert both.status_code == 400 and "add_generation_prompt" in both.text
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"


def test_a_final_message_marked_as_the_replys_start_is_continued(
        real_server: ServerProcess, model: str, reference) -> None:
    """DeepSeek's chat prefix completion (its beta base URL, `prefix: true`, through the
    openai SDK), Mistral's `prefix` (through the mistralai SDK) and Moonshot's `partial`
    continue the final assistant message, as vLLM's continue_final_message does; a
    message so marked that is not the final one is a 400."""
    prompt = reference.tokenizer.apply_chat_template(CAPITAL, continue_final_message=True)
    expected = reference(prompt, PREFILL_TOKENS)

    def marked(field: str, at: int = -1) -> list[dict]:
        chat = [*CAPITAL, {"role": "user", "content": "Again."}] if at != -1 else CAPITAL
        return [{**message, field: True} if index == at % len(chat) else message
                for index, message in enumerate(chat)]

    deepseek = openai.OpenAI(base_url=f"{real_server.url}/beta", api_key=API_KEY,
                             max_retries=0)
    reply = deepseek.chat.completions.create(model=model, messages=marked("prefix"),
                                             max_tokens=PREFILL_TOKENS, temperature=0)
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == len(prompt)
    mistral = Mistral(api_key=API_KEY, server_url=real_server.url)
    reply = mistral.chat.complete(model=model, messages=marked("prefix"),
                                  max_tokens=PREFILL_TOKENS, temperature=0)
    assert reply.choices[0].message.content == expected
    moonshot = openai.OpenAI(base_url=f"{real_server.url}/v1", api_key=API_KEY, max_retries=0)
    reply = moonshot.chat.completions.create(model=model, messages=marked("partial"),
                                             max_tokens=PREFILL_TOKENS, temperature=0)
    assert reply.choices[0].message.content == expected
    with pytest.raises(openai.BadRequestError) as refused:
        moonshot.chat.completions.create(model=model, messages=marked("prefix", at=1),
                                         max_tokens=PREFILL_TOKENS)
    assert refused.value.body["param"] == "messages"


# -- echo with prompt logprobs -----------------------------------------------------------

SCORED = ["The capital of France is Paris.", "The capital of France is Rome."]


def direct_logprobs(reference, tokens: list[int]) -> list[float]:
    """Each token's logprob given those before it: log_softmax of one plain forward."""
    logits = reference.model(mx.array([tokens]))[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return [logprobs[i, tokens[i + 1]].item() for i in range(len(tokens) - 1)]


def test_echo_scores_prompts_as_a_direct_forward_cached_or_not(
        client: openai.OpenAI, model: str, reference) -> None:
    """lm-evaluation-harness's loglikelihood request, twice: the second finds the prompts
    cached and must score them the same."""
    expected = [direct_logprobs(reference, reference.tokenizer.encode(text))
                for text in SCORED]
    cold, warm = (client.completions.create(model=model, prompt=SCORED, echo=True,
                                            logprobs=2, max_tokens=0, temperature=0)
                  for _ in range(2))
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    for response in (cold, warm):
        assert response.usage.completion_tokens == 0
        for choice in response.choices:
            logprobs = choice.logprobs
            assert choice.text == SCORED[choice.index]
            assert choice.finish_reason == "length"
            assert "".join(logprobs.tokens) == choice.text
            assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
            assert logprobs.token_logprobs[1:] == pytest.approx(expected[choice.index],
                                                                abs=1e-4)
            assert all(len(top) == 2 for top in logprobs.top_logprobs[1:])
            assert logprobs.text_offset[-1] == len(choice.text) - len(logprobs.tokens[-1])
    paris, rome = (sum(choice.logprobs.token_logprobs[1:]) for choice in cold.choices)
    assert paris > rome


def test_echo_then_a_completion(client: openai.OpenAI, model: str, reference) -> None:
    prompt = reference.tokenizer.encode(SCORED[0])
    response = client.completions.create(model=model, prompt=prompt, echo=True, logprobs=0,
                                         max_tokens=2, temperature=0)
    [choice] = response.choices
    logprobs = choice.logprobs
    assert choice.text.startswith(SCORED[0]) and len(logprobs.tokens) == len(prompt) + 2
    assert logprobs.token_logprobs[1:len(prompt)] == pytest.approx(
        direct_logprobs(reference, prompt), abs=1e-4)
    assert "".join(logprobs.tokens) == choice.text
