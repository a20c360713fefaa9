"""The OpenAI API end to end: the official SDK (sync and async, streaming and not) and
raw HTTP against a real server process on the tiny demo model."""

from __future__ import annotations

import asyncio
import json
import socket
import uuid

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from tokenizers import Tokenizer

from tests.server.support import ALIAS, ServerProcess

# Random weights rarely emit EOS, but a test that counts tokens must not depend on luck.
NO_EOS = {"ignore_eos": True}


def _messages(text: str = "Say something.") -> list[dict]:
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": text}]},
    ]


def test_models_lists_the_model_and_its_alias(client: openai.OpenAI, model_id: str) -> None:
    assert [model.id for model in client.models.list()] == [model_id, ALIAS]
    assert client.models.retrieve(ALIAS).id == ALIAS
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("gpt-4o")
    assert raised.value.code == "model_not_found"


def test_chat_response_shape_usage_and_logprobs(client: openai.OpenAI, model_id: str) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=model_id, messages=_messages(), max_tokens=6, n=2, logprobs=True,
        top_logprobs=2, extra_body=NO_EOS,
    )
    body = raw.http_response.json()
    response = ChatCompletion.model_validate(body)  # the SDK's own schema
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert [choice.index for choice in response.choices] == [0, 1]
    for choice in response.choices:
        assert choice.finish_reason == "length"
        assert choice.message.role == "assistant"
        assert isinstance(choice.message.content, str)
        assert len(choice.logprobs.content) == 6
        for token in choice.logprobs.content:
            assert token.logprob <= 0 and len(token.top_logprobs) == 2
            if "\ufffd" not in token.token:  # a whole character or more
                assert bytes(token.bytes) == token.token.encode("utf-8")
    usage = response.usage
    assert usage.completion_tokens == 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


def test_logprob_bytes_are_the_tokens_own(client: openai.OpenAI, model_id: str,
                                         demo_model_dir) -> None:
    """A token that holds part of a character reports those bytes, not U+FFFD's: joined,
    the bytes of a character's tokens give the character."""
    tokenizer = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    emoji = " \U0001f600"
    first = tokenizer.encode(emoji, add_special_tokens=False).ids[0]
    response = client.chat.completions.create(
        model=model_id, messages=_messages(), max_tokens=1, logprobs=True,
        logit_bias={str(first): 100},
    )
    token = response.choices[0].logprobs.content[0]
    assert token.token == tokenizer.decode([first])
    assert 0 < len(token.bytes) < len(emoji.encode()) and emoji.encode().startswith(
        bytes(token.bytes))


def test_chat_stream_matches_non_stream(client: openai.OpenAI, model_id: str) -> None:
    options = {
        "model": ALIAS, "messages": _messages("Stream it."), "max_completion_tokens": 8,
        "temperature": 0, "extra_body": NO_EOS,
    }
    whole = client.chat.completions.create(**options)
    chunks = list(client.chat.completions.create(
        **options, stream=True, stream_options={"include_usage": True}
    ))
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk.model_dump())
        assert chunk.id == chunks[0].id and chunk.object == "chat.completion.chunk"
        assert chunk.model == ALIAS
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, last = chunks
    assert all(chunk.usage is None for chunk in body)
    assert last.choices == []
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == whole.usage.completion_tokens == 8
    # The same prompt again: all but its last token came from the radix cache.
    assert last.usage.prompt_tokens_details.cached_tokens == last.usage.prompt_tokens - 1
    assert "".join(chunk.choices[0].delta.content or "" for chunk in body) == (
        whole.choices[0].message.content
    )
    assert [chunk.choices[0].finish_reason for chunk in body][-1] == "length"


def test_a_service_tier_asked_for_is_answered_with_the_one_that_served(
    client: openai.OpenAI, model_id: str
) -> None:
    """OpenAI's response names the tier that served a request that named one: "default"
    here, the only one, in the whole response and every chunk; unasked, none is said."""
    options = {"model": model_id, "messages": _messages(), "max_tokens": 2}
    assert client.chat.completions.create(**options).service_tier is None
    for asked in ("auto", "flex", "priority"):
        assert client.chat.completions.create(**options, service_tier=asked).service_tier == (
            "default")
        chunks = list(client.chat.completions.create(
            **options, service_tier=asked, stream=True, stream_options={"include_usage": True}))
        assert {chunk.service_tier for chunk in chunks} == {"default"}


def test_chat_stream_on_the_wire(server: ServerProcess, headers: dict[str, str],
                                 model_id: str) -> None:
    """The bytes OpenAI's SDKs parse: SSE headers, `data: JSON` events ended by a blank
    CRLF line, each choice's role chunk first, then content, each choice's finish, the
    usage chunk (no choices) and `[DONE]` last."""
    body = {"model": model_id, "messages": _messages(), "max_tokens": 3, "n": 2,
            "stream": True, "stream_options": {"include_usage": True}, **NO_EOS}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                      headers=headers, timeout=30) as response:
        raw = response.read()
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert response.headers["cache-control"] == "no-store"
    assert response.headers["x-accel-buffering"] == "no"
    *events, end = raw.split(b"\r\n\r\n")
    assert end == b"" and all(event.startswith(b"data: ") for event in events)
    *chunks, done = [json.loads(event[6:]) if event != b"data: [DONE]" else "[DONE]"
                     for event in events]
    assert done == "[DONE]"
    *choices, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert [chunk["choices"][0]["delta"].get("role") for chunk in choices[:2]] == [
        "assistant", "assistant"]
    for index in (0, 1):  # choices interleave; each ends with its finish
        own = [chunk["choices"][0] for chunk in choices if chunk["choices"][0]["index"] == index]
        assert [choice["finish_reason"] for choice in own][-2:] == [None, "length"]


def _http_1_0(server: ServerProcess, headers: dict[str, str], body: dict) -> tuple[bytes, bytes]:
    """POST /v1/chat/completions as an HTTP/1.0 client: (the response's head, its body,
    read until the server closes the connection)."""
    data = json.dumps(body).encode()
    head = "".join(f"{name}: {value}\r\n" for name, value in {
        **headers, "Content-Type": "application/json", "Content-Length": len(data)}.items())
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(f"POST /v1/chat/completions HTTP/1.0\r\n{head}\r\n".encode() + data)
        raw = b"".join(iter(lambda: connection.recv(65536), b""))
    response_head, _, content = raw.partition(b"\r\n\r\n")
    assert response_head.startswith(b"HTTP/1.1 200")
    return response_head.lower(), content


def test_an_http_1_0_client_gets_its_stream_unchunked_until_the_connection_closes(
        server: ServerProcess, headers: dict[str, str], model_id: str) -> None:
    """HTTP/1.0 has no chunked transfer coding; nginx proxies upstream in HTTP/1.0
    unless told otherwise. A whole response keeps its length."""
    body = {"model": model_id, "messages": _messages(), "max_tokens": 3, **NO_EOS}
    head, content = _http_1_0(server, headers, {**body, "stream": True})
    assert b"transfer-encoding" not in head and b"connection: close" in head
    assert content.startswith(b"data: {") and content.endswith(b"data: [DONE]\r\n\r\n")
    head, content = _http_1_0(server, headers, body)
    assert f"content-length: {len(content)}".encode() in head
    assert json.loads(content)["choices"][0]["finish_reason"] == "length"


def test_completions_batch_indexes_prompts_times_n(client: openai.OpenAI, model_id: str) -> None:
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    raw = client.completions.with_raw_response.create(
        model=model_id, prompt=prompts, n=2, max_tokens=5, logprobs=2, extra_body=NO_EOS,
    )
    response = Completion.model_validate(raw.http_response.json())
    assert response.object == "text_completion" and response.id.startswith("cmpl-")
    assert [choice.index for choice in response.choices] == [0, 1, 2, 3]
    for choice in response.choices:
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
        assert all(len(top) <= 2 for top in logprobs.top_logprobs)
        assert logprobs.text_offset == sorted(logprobs.text_offset)
    assert response.usage.prompt_tokens == 7
    assert response.usage.completion_tokens == 20
    assert response.usage.total_tokens == 27


def test_a_list_of_one_token_prompts_gets_one_choice_each_in_order(
    client: openai.OpenAI, model_id: str
) -> None:
    # Classification: sentences behind a shared instruction, one token each.
    preamble = list(range(40, 70))
    prompts = [[*preamble, 300 + 7 * i, 301 + 7 * i, 302 + 7 * i] for i in range(12)]
    alone = [client.completions.create(model=model_id, prompt=prompt, max_tokens=1,
                                       temperature=0, extra_body=NO_EOS).choices[0].text
             for prompt in prompts]
    response = client.completions.create(model=model_id, prompt=prompts, max_tokens=1,
                                         temperature=0, extra_body=NO_EOS)
    assert [choice.index for choice in response.choices] == list(range(12))
    assert [choice.text for choice in response.choices] == alone
    assert {choice.finish_reason for choice in response.choices} == {"length"}
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (12 * 33, 12)
    # Each prompt was sent alone first: all of it but its last token is cached.
    assert response.usage.prompt_tokens_details.cached_tokens == 12 * 32


async def test_echo_streamed_matches_whole_for_each_prompt_and_choice(
    async_client: openai.AsyncOpenAI, model_id: str
) -> None:
    """Every choice starts with its own prompt (text as given, token ids decoded) and its
    prompt tokens' logprobs; streamed, in the choice's first chunk."""
    options = {"model": model_id, "prompt": ["Once upon a time", "In a hole"], "n": 2,
               "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1,
               "extra_body": NO_EOS}
    whole = await async_client.completions.create(**options)
    stream = await async_client.completions.create(**options, stream=True)
    chunks = [chunk.choices[0] async for chunk in stream]
    for choice in whole.choices:
        prompt = options["prompt"][choice.index // 2]
        assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
        assert choice.logprobs.token_logprobs[0] is None
        assert None not in choice.logprobs.token_logprobs[1:]
        own = [chunk for chunk in chunks if chunk.index == choice.index]
        assert own[0].text == prompt and own[0].logprobs.token_logprobs[0] is None
        assert "".join(chunk.text for chunk in own) == choice.text
        scored = [chunk.logprobs for chunk in own if chunk.logprobs]
        assert [t for part in scored for t in part.tokens] == choice.logprobs.tokens
        assert [o for part in scored for o in part.text_offset] == choice.logprobs.text_offset
    plain = await async_client.completions.create(
        model=model_id, prompt=[5, 6, 7], max_tokens=0, echo=True)
    assert plain.choices[0].logprobs is None and plain.choices[0].text
    assert plain.usage.completion_tokens == 0


async def test_async_completion_stream_matches_non_stream(
    async_client: openai.AsyncOpenAI, model_id: str
) -> None:
    options = {"model": model_id, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
                   "extra_body": NO_EOS}
    whole = await async_client.completions.create(**options)
    stream = await async_client.completions.create(
        **options, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    *body, last = chunks
    assert "".join(chunk.choices[0].text for chunk in body) == whole.choices[0].text
    assert body[-1].choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage.completion_tokens == 8


def test_shared_prefix_reports_cached_tokens(client: openai.OpenAI, model_id: str) -> None:
    # Unique per run, so nothing but the first request below can have cached it.
    system = f"Session {uuid.uuid4().hex}. " + "Follow the house style guide closely. " * 30
    usages = []
    for question in ("What is a radix tree?", "What is a prefix cache?"):
        response = client.chat.completions.create(
            model=model_id, max_tokens=2,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        )
        usages.append(response.usage)
    first, second = usages
    assert first.prompt_tokens_details.cached_tokens < 10
    assert second.prompt_tokens_details.cached_tokens > 150


async def test_sixteen_concurrent_streams(async_client: openai.AsyncOpenAI, model_id: str) -> None:
    async def one(i: int) -> tuple[str, openai.types.CompletionUsage]:
        stream = await async_client.chat.completions.create(
            model=model_id, messages=_messages(f"Request {i}."), max_tokens=12, stream=True,
            stream_options={"include_usage": True}, extra_body=NO_EOS,
        )
        chunks = [chunk async for chunk in stream]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        return finish, chunks[-1].usage

    results = await asyncio.gather(*(one(i) for i in range(16)))
    prompt_tokens = {usage.prompt_tokens for _, usage in results}
    assert len(prompt_tokens) <= 2  # "Request 9." and "Request 10." may tokenize differently
    for finish, usage in results:
        assert finish == "length" and usage.completion_tokens == 12
        assert usage.total_tokens == usage.prompt_tokens + 12


def test_seed_makes_sampling_reproducible(client: openai.OpenAI, model_id: str) -> None:
    options = {
        "model": model_id, "prompt": "The weather", "max_tokens": 8, "temperature": 1.0,
        "seed": 7, "n": 2, "extra_body": NO_EOS,
    }
    first = client.completions.create(**options)
    second = client.completions.create(**options)
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.choices[0].text != first.choices[1].text  # seed + i per choice


def test_seed_minus_one_is_no_seed(client: openai.OpenAI, model_id: str) -> None:
    """llama.cpp's front ends send seed -1 for "random": each request samples anew, as
    one with no seed does (OpenAI's seeds are otherwise non-negative here)."""
    options = {"model": model_id, "prompt": "The weather", "max_tokens": 8,
               "temperature": 1.0, "seed": -1, "extra_body": NO_EOS}
    texts = {client.completions.create(**options).choices[0].text for _ in range(3)}
    assert len(texts) > 1
    with pytest.raises(openai.BadRequestError, match="seed"):
        client.completions.create(**{**options, "seed": -2})


@pytest.mark.parametrize("knobs", [{"temperature": 1e-40}, {"temperature": 1e-6},
                                   {"top_p": 1e-300}, {"top_p": 0}],
                         ids=["temperature-1e-40", "temperature-1e-6", "top_p-1e-300", "top_p-0"])
def test_a_vanishing_temperature_or_nucleus_is_greedy(client: openai.OpenAI, model_id: str,
                                                      knobs: dict) -> None:
    """They leave no other token a chance: the greedy answer, with its logprobs (1 / T of
    1e-40 overflowed float32 and drew token 0 every time)."""
    options = {"model": model_id, "prompt": "The weather", "max_tokens": 8, "logprobs": 1,
               "extra_body": NO_EOS}
    greedy = client.completions.create(**options, temperature=0).choices[0]
    vanishing = client.completions.create(**options, **knobs).choices[0]
    assert vanishing.text == greedy.text
    assert vanishing.logprobs.tokens == greedy.logprobs.tokens


def test_stop_string_ends_the_choice(client: openai.OpenAI, model_id: str) -> None:
    options = {"model": model_id, "prompt": [3, 4, 5, 6], "temperature": 0, "extra_body": NO_EOS}
    text = client.completions.create(**options, max_tokens=24).choices[0].text
    stop = text[len(text) // 2:][:3]
    stopped = client.completions.create(**options, max_tokens=24, stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.index(stop)]
    # Continue's autocomplete sends its template's stop strings and its own, 12 in all, to
    # any server but OpenAI's; the one that matches still ends the choice.
    continues = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<|endoftext|>", "<file_sep>",
                 "<repo_name>", "<|im_end|>", "\n\n\n", "/src/", "#- coding: utf-8", "```"]
    stopped = client.completions.create(**options, max_tokens=24,
                                        stop=[*continues, stop]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.index(stop)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_strings_tokens_get_no_logprobs(client: openai.OpenAI, model_id: str,
                                               stream: bool) -> None:
    """The logprobs cover the tokens of the text returned: those of a stop string, held
    back until it matched, are not listed (they were, streamed or not)."""
    options = {"model": model_id, "prompt": [3, 4, 5, 6], "temperature": 0, "logprobs": 1,
               "max_tokens": 16, "extra_body": NO_EOS}
    tokens = client.completions.create(**options).choices[0].logprobs.tokens
    whole = "".join(tokens)
    kept = next(k for k in range(2, 12)
                if whole.index("".join(tokens[k:k + 3])) == len("".join(tokens[:k])))
    stop = "".join(tokens[kept:kept + 3])
    if stream:
        chunks = [c.choices[0] for c in client.completions.create(**options, stop=[stop], stream=True)]
        listed = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
        text, reason = "".join(c.text for c in chunks), chunks[-1].finish_reason
    else:
        stopped = client.completions.create(**options, stop=[stop]).choices[0]
        listed, text, reason = stopped.logprobs.tokens, stopped.text, stopped.finish_reason
    assert reason == "stop" and text == "".join(tokens[:kept])
    assert listed == tokens[:kept]


def test_logit_bias_forces_a_token(client: openai.OpenAI, model_id: str) -> None:
    response = client.completions.create(
        model=model_id, prompt=[3, 4, 5], max_tokens=4, temperature=0, logprobs=0,
        logit_bias={"300": 100}, extra_body=NO_EOS,
    )
    tokens = response.choices[0].logprobs.tokens
    assert len(tokens) == 4 and len(set(tokens)) == 1


def test_tools_are_rendered_into_the_prompt(client: openai.OpenAI, model_id: str) -> None:
    tools = [{
        "type": "function",
        "function": {
            "name": "get_weather", "description": "Weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }]
    messages = _messages("Weather in Paris?")

    def prompt_tokens(**options) -> int:
        response = client.chat.completions.create(
            model=model_id, messages=messages, max_tokens=2, **options
        )
        assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")
        return response.usage.prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(tools=tools) > plain + 20
    # "none" forbids calls but shows the tools, so the prompt (and its cache) stays.
    assert prompt_tokens(tools=tools, tool_choice="none") == prompt_tokens(tools=tools)


def test_a_refused_turn_sent_back_reads_as_its_text(
    client: openai.OpenAI, model_id: str
) -> None:
    """OpenAI's assistant message may hold a refusal instead of content, or refusal parts:
    a client replaying a refused turn sends it as it came."""
    def prompt_tokens(assistant: dict) -> int:
        return client.chat.completions.create(model=model_id, max_tokens=1, messages=[
            {"role": "user", "content": "Tell me a secret."},
            {"role": "assistant", **assistant},
            {"role": "user", "content": "Why not?"}]).usage.prompt_tokens

    text = prompt_tokens({"content": "I can't share that."})
    assert prompt_tokens({"content": None, "refusal": "I can't share that."}) == text
    assert prompt_tokens({"content": [{"type": "refusal", "refusal": "I can't share that."}]}) \
        == text


def test_assistant_tool_calls_in_history_render(client: openai.OpenAI, model_id: str) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    response = client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=8, temperature=0, extra_body=NO_EOS
    )
    assert response.usage.prompt_tokens > 20
    # The demo template renders the call with its arguments as a mapping (OpenAI sends a
    # JSON string), then the tool's answer: the same prompt, as text, gives the same
    # prompt tokens and the same greedy reply.
    rendered = (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n"
    )
    completion = client.completions.create(
        model=model_id, prompt=rendered, max_tokens=8, temperature=0, extra_body=NO_EOS
    )
    assert completion.usage.prompt_tokens == response.usage.prompt_tokens
    assert completion.choices[0].text == response.choices[0].message.content


def test_unknown_fields_are_ignored(server: ServerProcess, headers: dict[str, str]) -> None:
    response = httpx.post(
        f"{server.url}/v1/completions", headers=headers, timeout=30,
        json={"prompt": "Hi", "max_tokens": 1, "frobnicate": True, "metadata": {"a": "b"}},
    )
    assert response.status_code == 200, response.text
