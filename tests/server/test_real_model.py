"""The real default model (SmolLM2-135M-Instruct) through the server: its chat template,
its answers, and greedy output identical to `mlx_lm.generate` on the same directory.

One server for the module; few, short generations (the model decodes ~14 tok/s in
float32 on 2 CPU cores)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import mlx_lm
import openai
import pytest

from tests.server.support import API_KEY, ServerProcess

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference(real_model_dir: Path):
    """mlx-lm itself on the same converted directory."""
    model, tokenizer = mlx_lm.load(str(real_model_dir))

    def greedy(messages: list[dict], max_tokens: int = MAX_TOKENS) -> tuple[str, int]:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        tokens = [response.token for response in mlx_lm.stream_generate(
            model, tokenizer, prompt, max_tokens=max_tokens)]
        ended = tokens and tokens[-1] in tokenizer.eos_token_ids
        return tokenizer.decode(tokens[:-1] if ended else tokens), len(tokens)

    greedy.tokenizer = tokenizer
    return greedy


def chat(messages: list[dict], **extra) -> dict:
    return {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


async def post(client: httpx.AsyncClient, body: dict) -> dict:
    response = await client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json()


def test_models_names_the_gguf_file(real_server: ServerProcess, real_model_dir: Path) -> None:
    models = httpx.get(f"{real_server.url}/v1/models", headers=AUTH, timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct.Q4_1"]
    assert real_model_dir.name == "SmolLM2-135M-Instruct.Q4_1"


def test_the_files_chat_template_renders(reference) -> None:
    """The template comes from the GGUF metadata, default system prompt included."""
    text = reference.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True,
                                                   tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


async def test_capital_of_france_is_paris_cold_cached_and_batched(
    real_server: ServerProcess, reference
) -> None:
    """Token-identical to mlx_lm.generate: cold, on a cache hit, and decoded in a batch
    beside other requests; the answer ends at the model's end-of-turn token (EOS)."""
    expected, expected_tokens = reference(QUESTION)
    assert "Paris" in expected
    follow_up = [*QUESTION, {"role": "assistant", "content": expected},
                 {"role": "user", "content": "And of Italy?"}]
    others = [[{"role": "user", "content": f"Name {n} colours."}] for n in (2, 3)]
    async with httpx.AsyncClient(base_url=real_server.url, timeout=120) as client:
        cold = await post(client, chat(QUESTION))
        hit = await post(client, chat(QUESTION))
        batched = await asyncio.gather(post(client, chat(follow_up)),
                                       *(post(client, chat(m)) for m in others))
    for answer in (cold, hit):
        assert answer["choices"][0]["message"]["content"] == expected
        assert answer["choices"][0]["finish_reason"] == "stop"
        assert answer["usage"]["completion_tokens"] == expected_tokens
    assert expected_tokens < MAX_TOKENS  # ended by EOS, not by the limit
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    italy, _ = reference(follow_up)
    assert "Rome" in italy
    assert batched[0]["choices"][0]["message"]["content"] == italy
    assert batched[0]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    for answer, messages in zip(batched[1:], others):
        assert answer["choices"][0]["message"]["content"] == reference(messages)[0]


def test_min_tokens_writes_past_the_end_of_a_real_answer(real_client, reference) -> None:
    """vLLM's `min_tokens` (the OpenAI SDK sends it in `extra_body`): the answer that
    ended at its end-of-turn token goes on, word for word the same before it, to at least
    that many tokens; fewer than it allows is a 400 naming it."""
    expected, expected_tokens = reference(QUESTION)
    least = expected_tokens + 8
    completion = real_client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=QUESTION, max_tokens=least + 8,
        temperature=0, extra_body={"min_tokens": least})
    assert completion.usage.completion_tokens >= least
    assert completion.choices[0].message.content.startswith(expected)
    with pytest.raises(openai.BadRequestError) as refused:
        real_client.chat.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1", messages=QUESTION, max_completion_tokens=4,
            extra_body={"min_tokens": 5})
    assert refused.value.body["param"] == "max_completion_tokens"


def test_a_stop_string_ends_a_real_answer(real_client) -> None:
    completion = real_client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=QUESTION, max_tokens=MAX_TOKENS,
        temperature=0, stop=[" Paris"],
    )
    choice = completion.choices[0]
    assert choice.message.content == "The capital of France is"
    assert choice.finish_reason == "stop"
