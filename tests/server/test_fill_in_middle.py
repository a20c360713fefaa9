"""Fill in the middle, as editors' autocomplete asks for it: OpenAI's `suffix`, Ollama's
`suffix` and llama.cpp's /infill prompt a code model with its fill-in-the-middle tokens
(here the tiny demo model with Qwen2.5-Coder's), the middle ends at the tokens that start
another file, and a model without such tokens refuses a suffix in each API's own words."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from mistralai.client import Mistral
from tokenizers import Tokenizer

from engine.demo_model import FILL_IN_MIDDLE_TOKENS, build_demo_model
from engine.fill_in_middle import SUFFIX_FIRST
from tests.server.support import ServerProcess, start_server

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"
EXTRA = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]
MAX_TOKENS = 12


def serve(model: Path, factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = start_server(model, factory.mktemp(f"{model.name}-log") / "server.log")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def coder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("coder") / "tiny-coder",
                            fill_in_middle=FILL_IN_MIDDLE_TOKENS)


@pytest.fixture(scope="module")
def coder(coder_dir: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[ServerProcess]:
    yield from serve(coder_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def vocabulary(coder_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(coder_dir / "tokenizer.json"))


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def fim_prompt(tokenizer: Tokenizer, prefix: str, suffix: str) -> list[int]:
    """Qwen2.5-Coder's prefix-suffix-middle prompt, spelled out."""
    def token(name: str) -> int:
        return tokenizer.token_to_id(name)
    return [token("<|fim_prefix|>"), *encode(tokenizer, prefix), token("<|fim_suffix|>"),
            *encode(tokenizer, suffix), token("<|fim_middle|>")]


def greedy(server: ServerProcess, prompt: str | list[int], **fields: object) -> dict:
    response = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": "tiny-coder", "prompt": prompt, "max_tokens": MAX_TOKENS,
        "temperature": 0, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def spelled_out(server: ServerProcess, tokenizer: Tokenizer, prompt: list[int]) -> dict:
    """The greedy completion of `prompt`, ended where a middle ends."""
    ends = [tokenizer.token_to_id(name)
            for name in ("<|repo_name|>", "<|file_sep|>", "<|fim_pad|>")]
    return greedy(server, prompt, stop_token_ids=ends)


def test_a_suffix_prompts_the_model_with_its_fill_in_the_middle_tokens(
        coder: ServerProcess, vocabulary: Tokenizer) -> None:
    client = openai.OpenAI(base_url=f"{coder.url}/v1", api_key="none")
    middle = client.completions.create(model="tiny-coder", prompt=PREFIX, suffix=SUFFIX,
                                       max_tokens=MAX_TOKENS, temperature=0)
    expected = spelled_out(coder, vocabulary, fim_prompt(vocabulary, PREFIX, SUFFIX))
    assert middle.choices[0].text == expected["choices"][0]["text"]
    assert middle.usage.prompt_tokens == expected["usage"]["prompt_tokens"]


def test_ollama_inserts_between_prompt_and_suffix_and_says_the_model_can(
        coder: ServerProcess, vocabulary: Tokenizer) -> None:
    expected = spelled_out(coder, vocabulary, fim_prompt(vocabulary, PREFIX, SUFFIX))
    reply = ollama.Client(host=coder.url).generate(
        model="tiny-coder", prompt=PREFIX, suffix=SUFFIX,
        system="left out, as Ollama's templates leave it out",
        options={"temperature": 0, "num_predict": MAX_TOKENS})
    assert reply.response == expected["choices"][0]["text"]
    assert reply.prompt_eval_count == expected["usage"]["prompt_tokens"]
    shown = httpx.post(f"{coder.url}/api/show", json={"model": "tiny-coder"}).json()
    assert "insert" in shown["capabilities"]
    # Continue offers a model for autocomplete where its template reads the suffix.
    assert shown["template"].startswith(
        "{{- if .Suffix }}<|fim_prefix|>{{ .Prompt }}<|fim_suffix|>{{ .Suffix }}<|fim_middle|>")


def test_infill_puts_the_projects_files_before_the_prefix_as_a_repository(
        coder: ServerProcess, vocabulary: Tokenizer) -> None:
    def token(name: str) -> int:
        return vocabulary.token_to_id(name)
    repository = [token("<|repo_name|>"), *encode(vocabulary, "myproject\n"),
                  token("<|file_sep|>"), *encode(vocabulary, "util.py\n"),
                  *encode(vocabulary, EXTRA[0]["text"]),
                  token("<|file_sep|>"), *encode(vocabulary, "filename\n")]
    expected = spelled_out(coder, vocabulary,
                           repository + fim_prompt(vocabulary, PREFIX + "x", SUFFIX))
    # llama.vscode's body: what is typed at the cursor (prompt) follows the prefix, and
    # llama.cpp's own fields that mean nothing here are ignored, as llama.cpp ignores
    # unknown ones.
    body = {"input_prefix": PREFIX, "prompt": "x", "input_suffix": SUFFIX,
            "input_extra": EXTRA, "n_predict": MAX_TOKENS, "temperature": 0,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True,
            "t_max_prompt_ms": 500, "response_fields": ["content", "timings/prompt_n"]}
    whole = httpx.post(f"{coder.url}/infill", json=body, timeout=60).json()
    assert whole["content"] == expected["choices"][0]["text"]
    assert whole["stop"] is True and whole["stop_type"] == "limit"
    assert whole["tokens_evaluated"] == whole["timings"]["prompt_n"] == (
        expected["usage"]["prompt_tokens"])
    assert whole["tokens_predicted"] == whole["timings"]["predicted_n"] == MAX_TOKENS

    with httpx.stream("POST", f"{coder.url}/infill", json={**body, "stream": True},
                      timeout=60) as stream:
        events = [json.loads(line.removeprefix("data: ")) for line in stream.iter_lines()
                  if line.startswith("data: ")]
    assert "".join(event["content"] for event in events) == whole["content"]
    assert [event["stop"] for event in events] == [False] * (len(events) - 1) + [True]
    assert events[-1]["tokens_predicted"] == MAX_TOKENS


def test_infill_cuts_a_project_larger_than_the_context_as_llama_cpp_does(
        coder: ServerProcess) -> None:
    """llama.vscode sends a ring of recently seen code that may outgrow the window: the
    prompt keeps the code at the gap and the files' latest tokens that fit, and answers."""
    files = [{"filename": f"f{i}.py", "text": f"value_{i} = {i}\n" * 40} for i in range(200)]
    answer = httpx.post(f"{coder.url}/infill", timeout=120, json={
        "input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": files,
        "n_predict": 4, "temperature": 0})
    assert answer.status_code == 200, answer.text
    assert 8192 - 4 - 2048 <= answer.json()["tokens_evaluated"] <= 8192 - 4


def test_a_middle_ends_where_the_model_starts_another_file(
        coder: ServerProcess, vocabulary: Tokenizer) -> None:
    file_separator = vocabulary.token_to_id("<|file_sep|>")
    middle = greedy(coder, PREFIX, suffix=SUFFIX, logit_bias={str(file_separator): 100})
    assert middle["choices"][0]["finish_reason"] == "stop"
    assert middle["choices"][0]["text"] == ""


def test_a_model_without_fill_in_the_middle_tokens_refuses_a_suffix(
        server: ServerProcess, headers: dict, model_id: str) -> None:
    completion = httpx.post(f"{server.url}/v1/completions", headers=headers, json={
        "model": model_id, "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 4})
    assert completion.status_code == 400
    assert completion.json()["error"]["param"] == "suffix"
    assert "does not support insert" in completion.json()["error"]["message"]
    ollama = httpx.post(f"{server.url}/api/generate", headers=headers, json={
        "model": model_id, "prompt": PREFIX, "suffix": SUFFIX, "stream": False})
    assert ollama.status_code == 400 and "does not support insert" in ollama.json()["error"]
    infill = httpx.post(f"{server.url}/infill", headers=headers, json={
        "model": model_id, "input_prefix": PREFIX, "input_suffix": SUFFIX})
    assert infill.status_code == 400 and infill.json()["error"]["param"] == "input_suffix"
    fim = httpx.post(f"{server.url}/v1/fim/completions", headers=headers, json={
        "model": model_id, "prompt": PREFIX})
    assert fim.status_code == 400 and "does not support insert" in fim.json()["error"]["message"]
    shown = httpx.post(f"{server.url}/api/show", headers=headers, json={"model": model_id})
    assert "insert" not in shown.json()["capabilities"]
    assert ".Suffix" not in shown.json()["template"]
    # An empty suffix asks for nothing to follow: a plain completion.
    plain = httpx.post(f"{server.url}/v1/completions", headers=headers, json={
        "model": model_id, "prompt": PREFIX, "suffix": "", "max_tokens": 2})
    assert plain.status_code == 200, plain.text


@pytest.mark.parametrize(("fields", "message"), [
    ({"echo": True}, "echo"),
    ({"prompt": [1, 2, 3]}, "token ids"),
], ids=["echo", "token ids"])
def test_a_suffix_with_what_it_cannot_follow_is_a_400(
        coder: ServerProcess, fields: dict, message: str) -> None:
    response = httpx.post(f"{coder.url}/v1/completions", json={
        "model": "tiny-coder", "prompt": PREFIX, "suffix": SUFFIX, **fields})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "suffix" and message in error["message"]


@pytest.fixture(scope="module")
def codestral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny demo model with Codestral's fill-in-the-middle tokens."""
    return build_demo_model(tmp_path_factory.mktemp("codestral") / "tiny-codestral",
                            fill_in_middle=SUFFIX_FIRST)


@pytest.fixture(scope="module")
def codestral(codestral_dir: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[ServerProcess]:
    yield from serve(codestral_dir, tmp_path_factory)


def test_codestral_fills_in_suffix_first_and_a_keystroke_reuses_the_whole_prompt(
        codestral: ServerProcess, codestral_dir: Path) -> None:
    """Codestral's order, `[SUFFIX] suffix [PREFIX] prefix`: typing at the cursor only
    lengthens the prompt's end, so the next completion reuses all that came before."""
    vocabulary = Tokenizer.from_file(str(codestral_dir / "tokenizer.json"))
    prefix_token, suffix_token = map(vocabulary.token_to_id, SUFFIX_FIRST)
    prompt = [suffix_token, *encode(vocabulary, SUFFIX), prefix_token,
              *encode(vocabulary, PREFIX)]
    client = openai.OpenAI(base_url=f"{codestral.url}/v1", api_key="none")

    def middle(prefix: str) -> openai.types.Completion:
        return client.completions.create(model="tiny-codestral", prompt=prefix,
                                         suffix=SUFFIX, max_tokens=MAX_TOKENS, temperature=0)

    first = middle(PREFIX)
    expected = greedy(codestral, prompt, model="tiny-codestral",
                      stop_token_ids=[prefix_token, suffix_token])
    assert first.choices[0].text == expected["choices"][0]["text"]
    assert first.usage.prompt_tokens == len(prompt)
    typed = middle(PREFIX + "ret")
    assert typed.usage.prompt_tokens_details.cached_tokens >= len(prompt) - 3
    shown = httpx.post(f"{codestral.url}/api/show", json={"model": "tiny-codestral"}).json()
    assert shown["template"].startswith(
        "{{- if .Suffix }}[SUFFIX]{{ .Suffix }}[PREFIX] {{ .Prompt }}{{- else }}")


def test_mistrals_fim_api_fills_in_the_same_middle(codestral: ServerProcess) -> None:
    """Mistral's fill in the middle (/v1/fim/completions: Continue's Mistral provider, the
    mistralai SDK) prompts the model as Completions' `suffix` does, answers in Chat
    Completions' shapes, and its streamed deltas, each with content, add up to it;
    `min_tokens` (vLLM's too) keeps the middle from ending before it."""
    completions = openai.OpenAI(base_url=f"{codestral.url}/v1", api_key="none")
    expected = completions.completions.create(
        model="tiny-codestral", prompt=PREFIX, suffix=SUFFIX, max_tokens=MAX_TOKENS,
        temperature=0)
    client = Mistral(api_key="none", server_url=codestral.url)
    fields = {"model": "tiny-codestral", "prompt": PREFIX, "suffix": SUFFIX,
              "max_tokens": MAX_TOKENS, "temperature": 0}
    whole = client.fim.complete(**fields)
    assert whole.choices[0].message.content == expected.choices[0].text
    assert whole.choices[0].finish_reason == expected.choices[0].finish_reason
    assert whole.usage.prompt_tokens == expected.usage.prompt_tokens
    deltas = [event.data.choices[0].delta.content for event in client.fim.stream(**fields)]
    assert None not in deltas and "".join(deltas) == whole.choices[0].message.content
    seeded = {**fields, "temperature": 1.0, "random_seed": 7}
    assert (client.fim.complete(**seeded).choices[0].message.content
            == client.fim.complete(**seeded).choices[0].message.content)
    filled = client.fim.complete(**fields, min_tokens=MAX_TOKENS)
    assert filled.usage.completion_tokens == MAX_TOKENS
    refused = httpx.post(f"{codestral.url}/v1/fim/completions",
                         json={**fields, "min_tokens": MAX_TOKENS + 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "min_tokens"


def test_deepseeks_beta_fim_path_is_completions_with_a_suffix(coder: ServerProcess) -> None:
    """DeepSeek serves fill in the middle as Completions with `suffix` under its beta base
    URL (https://api.deepseek.com/beta, POST /completions): the openai SDK pointed at it
    gets the same middle as from /v1/completions, whole and streamed."""
    fields = {"model": "tiny-coder", "prompt": PREFIX, "suffix": SUFFIX,
              "max_tokens": MAX_TOKENS, "temperature": 0}
    expected = openai.OpenAI(base_url=f"{coder.url}/v1", api_key="none").completions.create(
        **fields)
    deepseek = openai.OpenAI(base_url=f"{coder.url}/beta", api_key="none")
    middle = deepseek.completions.create(**fields)
    assert middle.object == "text_completion"
    assert middle.choices[0].text == expected.choices[0].text
    assert middle.usage.prompt_tokens == expected.usage.prompt_tokens
    streamed = "".join(chunk.choices[0].text for chunk in deepseek.completions.create(
        **fields, stream=True) if chunk.choices)
    assert streamed == expected.choices[0].text
