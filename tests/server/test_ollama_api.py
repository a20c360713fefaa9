"""Ollama's native API (/api), driven by Ollama's own Python client: what a client built
for Ollama sends, answered by the same engine and cache as the OpenAI routes."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import jsonschema
import mlx.core as mx
import numpy as np
import ollama
import openai
import pytest
from pydantic import ValidationError

from engine.image_tokens import MARKER
from engine.loader import load_tokenizer
from engine.weights_summary import human_number
from server.clock import Clock
from server.events import (
    ChoiceFinished,
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallStarted,
    Usage,
)
from server.ollama.adapter import (
    OllamaReply,
    chat_request,
    generate_request,
    image_url,
    whole,
)
from server.ollama.protocol import ChatRequest, GenerateRequest
from tests.server.support import API_KEY, ServerProcess, start_server
from tests.server.thinking_model import build_thinking_model

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GREEDY = {"temperature": 0, "num_predict": 8}
HI = [{"role": "user", "content": "Say hi."}]
CITY = {"type": "object", "properties": {"name": {"type": "string"},
                                         "population": {"type": "integer"}},
        "required": ["name", "population"], "additionalProperties": False}
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(32)).decode()


@pytest.fixture(scope="module")
def olla(server: ServerProcess) -> ollama.Client:
    return ollama.Client(host=server.url, headers=AUTH)


def test_clients_find_the_served_model_and_what_it_can_do(
        olla: ollama.Client, model_id: str, demo_model_dir: Path) -> None:
    version = olla._client.get("/api/version").json()["version"]
    assert tuple(map(int, version.split("."))) >= (0, 6)  # what clients check for
    listed = {model.model: model for model in olla.list().models}
    assert model_id in listed and listed[model_id].size > 0
    assert len(listed[model_id].digest) == 64
    shown = olla.show(model_id)
    assert shown.capabilities == ["completion", "tools"]
    # Its size and type as Ollama words them (format.HumanNumber, the file's dtype).
    weights = mx.load(str(demo_model_dir / "model.safetensors"))
    assert shown.details.parameter_size == human_number(sum(w.size for w in weights.values()))
    assert shown.details.quantization_level == "F32"
    assert listed[model_id].details.parameter_size == shown.details.parameter_size
    assert shown.modelinfo[f"{shown.details.family}.context_length"] > 0
    # Its context window as a Modelfile's parameter, which Continue sizes its prompts by.
    assert f"num_ctx {shown.modelinfo[f'{shown.details.family}.context_length']}" in (
        shown.parameters or "").splitlines()
    assert shown.modelinfo[f"{shown.details.family}.embedding_length"] == len(
        olla.embed(model=model_id, input="x").embeddings[0])
    [running] = [model for model in olla.ps().models if model.model == model_id]
    # Listed, its files' bytes; running, its weights' in memory: the same float32 values.
    assert 0 <= listed[model_id].size - running.size_vram < 1e5
    assert running.expires_at.year == 9999
    with pytest.raises(ollama.ResponseError) as missing:
        olla.show("no-such-model")
    assert missing.value.status_code == 404 and "no-such-model" in missing.value.error


def test_a_streamed_chat_adds_up_to_the_whole_one_and_to_openais(
        olla: ollama.Client, client: openai.OpenAI, model_id: str) -> None:
    whole = olla.chat(model=model_id, messages=HI, options=GREEDY)
    parts = list(olla.chat(model=model_id, messages=HI, options=GREEDY, stream=True))
    assert "".join(part.message.content for part in parts) == whole.message.content
    assert [part.done for part in parts] == [False] * (len(parts) - 1) + [True]
    last = parts[-1]
    assert (last.done_reason, last.eval_count) == ("length", 8)
    assert last.prompt_eval_count == whole.prompt_eval_count > 0
    assert 0 < last.eval_duration < last.total_duration
    # The same engine, template and cache answer the same chat through OpenAI's API.
    same = client.chat.completions.create(model=model_id, messages=HI, max_tokens=8,
                                          temperature=0)
    assert same.choices[0].message.content == whole.message.content
    assert same.usage.prompt_tokens == whole.prompt_eval_count


def test_logprobs_are_the_answer_tokens_streamed_or_whole_as_openais(
        olla: ollama.Client, client: openai.OpenAI, model_id: str) -> None:
    whole = olla.chat(model=model_id, messages=HI, options=GREEDY, logprobs=True,
                      top_logprobs=2)
    assert len(whole.logprobs) == whole.eval_count == 8
    assert "".join(logprob.token for logprob in whole.logprobs) == whole.message.content
    assert all(len(logprob.top_logprobs) == 2 for logprob in whole.logprobs)
    parts = list(olla.chat(model=model_id, messages=HI, options=GREEDY, logprobs=True,
                           top_logprobs=2, stream=True))
    assert [lp.model_dump() for part in parts for lp in part.logprobs or ()] == [
        lp.model_dump() for lp in whole.logprobs]
    theirs = client.chat.completions.create(model=model_id, messages=HI, max_tokens=8,
                                            temperature=0, logprobs=True, top_logprobs=2)
    assert [lp.logprob for lp in whole.logprobs] == pytest.approx(
        [lp.logprob for lp in theirs.choices[0].logprobs.content], abs=1e-4)
    # Each token's own bytes, as Ollama gives them beside its text (OpenAI's too).
    listed = olla._client.post("/api/chat", json={
        "model": model_id, "messages": HI, "options": GREEDY, "logprobs": True,
        "top_logprobs": 1, "stream": False}).json()["logprobs"]
    assert [entry["bytes"] for entry in listed] == [
        lp.bytes for lp in theirs.choices[0].logprobs.content]
    assert all(entry["top_logprobs"][0]["bytes"] for entry in listed)
    assert olla.chat(model=model_id, messages=HI, options=GREEDY).logprobs is None


def test_a_temperature_past_openais_bound_is_ollamas_to_take(
        olla: ollama.Client, model_id: str) -> None:
    """Ollama bounds no option's temperature (OpenAI's is 2): a hot one is sampled, not a
    400."""
    hot = olla.chat(model=model_id, messages=HI, options={"temperature": 5, "num_predict": 4})
    assert hot.done and hot.eval_count == 4


def test_generate_templated_or_raw_answers_as_openais_chat_and_completions(
        olla: ollama.Client, client: openai.OpenAI, model_id: str) -> None:
    templated = olla.generate(model=model_id, prompt="Say hi.", options=GREEDY)
    chat = client.chat.completions.create(model=model_id, messages=HI, max_tokens=8,
                                          temperature=0)
    assert templated.response == chat.choices[0].message.content
    raw = olla.generate(model=model_id, prompt="Once upon a time", raw=True, options=GREEDY)
    completion = client.completions.create(model=model_id, prompt="Once upon a time",
                                           max_tokens=8, temperature=0)
    assert raw.response == completion.choices[0].text


def test_a_final_assistant_message_is_continued_as_ollama_continues_it(
        olla: ollama.Client, client: openai.OpenAI, model_id: str) -> None:
    """Ollama's templates leave a final assistant message open, and the reply continues
    it (its answer to a prefill); it was closed, and a new assistant turn answered."""
    prefill = [*HI, {"role": "assistant", "content": "Hi! I am"}]
    continued = olla.chat(model=model_id, messages=prefill, options=GREEDY)
    same = client.chat.completions.create(
        model=model_id, messages=prefill, max_tokens=8, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert continued.message.content == same.choices[0].message.content
    assert continued.prompt_eval_count == same.usage.prompt_tokens
    # An empty one asks for a plain reply, as the chat without it; alone, it is rendered.
    plain = olla.chat(model=model_id, messages=[*HI, {"role": "assistant", "content": ""}],
                      options=GREEDY)
    assert plain.message.content == olla.chat(model=model_id, messages=HI,
                                              options=GREEDY).message.content
    alone = olla.chat(model=model_id, messages=[{"role": "assistant", "content": ""}],
                      options=GREEDY)
    assert alone.eval_count == 8


def test_a_format_schema_binds_the_reply(olla: ollama.Client, model_id: str) -> None:
    """Random weights write the schema's object only because the grammar makes them."""
    reply = olla.chat(model=model_id, messages=[{"role": "user", "content": "A city?"}],
                      format=CITY, options={"num_predict": 80, "seed": 3})
    assert reply.done_reason == "stop"
    jsonschema.validate(json.loads(reply.message.content), CITY)


def test_embed_gives_the_vectors_openais_embeddings_do(
        olla: ollama.Client, client: openai.OpenAI, model_id: str) -> None:
    embedded = olla.embed(model=model_id, input=["hello there", "general kenobi"])
    theirs = client.embeddings.create(model=model_id, input=["hello there", "general kenobi"])
    for ours, openais in zip(embedded.embeddings, theirs.data, strict=True):
        assert ours == pytest.approx(openais.embedding, abs=1e-6)
    assert embedded.prompt_eval_count == theirs.usage.prompt_tokens
    assert olla.embeddings(model=model_id, prompt="hello there").embedding == pytest.approx(
        embedded.embeddings[0], abs=1e-6)


def test_embed_dimensions_cut_any_model_s_vectors_and_renormalise_them(
        olla: ollama.Client, server: ServerProcess, model_id: str) -> None:
    """Ollama cuts each vector to `dimensions` and renormalises it, whatever the model
    was trained for; a size not under the model's own gives the whole vectors."""
    [whole] = olla.embed(model=model_id, input="hello there").embeddings

    def embedded(dimensions: int) -> list[float]:
        response = httpx.post(f"{server.url}/api/embed", headers=AUTH, timeout=60, json={
            "model": model_id, "input": "hello there", "dimensions": dimensions})
        assert response.status_code == 200, response.text
        return response.json()["embeddings"][0]

    prefix = np.asarray(whole[:4])
    assert embedded(4) == pytest.approx(prefix / np.linalg.norm(prefix), abs=1e-5)
    assert embedded(len(whole) + 1) == pytest.approx(whole, abs=1e-6)


def test_embed_cuts_inputs_to_num_ctx_or_refuses_them_without_truncate(
        server: ServerProcess, client: openai.OpenAI, model_id: str) -> None:
    """Ollama's embed reads num_ctx as the input's window: truncate (its default) cuts an
    input to its first num_ctx tokens, as /v1/embeddings' truncate_prompt_tokens does;
    truncate false refuses it."""
    text = "a sentence long enough to be cut at a few tokens of the model's"

    def embed(**fields) -> httpx.Response:
        return httpx.post(f"{server.url}/api/embed", headers=AUTH, timeout=60, json={
            "model": model_id, "input": text, "options": {"num_ctx": 6}, **fields})

    cut = embed()
    assert cut.status_code == 200, cut.text
    assert cut.json()["prompt_eval_count"] == 6
    theirs = client.embeddings.create(model=model_id, input=text,
                                      extra_body={"truncate_prompt_tokens": 6})
    assert cut.json()["embeddings"][0] == pytest.approx(theirs.data[0].embedding, abs=1e-6)
    refused = embed(truncate=False)
    assert refused.status_code == 400
    assert "context length is 6" in refused.json()["error"]


def test_an_empty_request_loads_the_model_and_the_only_one_is_not_unloaded(
        olla: ollama.Client, model_id: str) -> None:
    loaded = olla.generate(model=model_id, prompt="")
    assert (loaded.done, loaded.done_reason, loaded.response) == (True, "load", "")
    assert olla.chat(model=model_id, messages=[]).done_reason == "load"
    assert olla.embed(model=model_id, input="").embeddings == []
    assert olla.embed(model=model_id, input=[]).embeddings == []
    assert olla.embeddings(model=model_id, prompt="").embedding == []
    # Ollama's client leaves a prompt it was not given out of the body; so may an input.
    assert olla.embeddings(model=model_id).embedding == []
    assert olla._client.post("/api/embed", json={"model": model_id}).json()["embeddings"] == []
    # Ollama's clients add its default tag to a name, and its replies echo the name sent.
    tagged = olla.generate(model=f"{model_id}:latest", prompt="")
    assert (tagged.model, tagged.done_reason) == (f"{model_id}:latest", "load")
    said = olla.chat(model=f"{model_id}:latest", messages=[{"role": "user", "content": "Hi"}],
                     options={"num_predict": 2})
    assert said.model == f"{model_id}:latest"
    assert olla.embed(model=f"{model_id}:latest", input="Hi").model == f"{model_id}:latest"
    assert olla.show(f"{model_id}:latest").capabilities == olla.show(model_id).capabilities
    with pytest.raises(ollama.ResponseError) as kept:
        olla.generate(model=model_id, prompt="", keep_alive=0)
    assert kept.value.status_code == 409 and "stays loaded" in kept.value.error


def test_a_body_is_json_whatever_its_content_type_says(server: ServerProcess,
                                                      model_id: str) -> None:
    """Ollama's own examples send curl's default type: `curl .../api/generate -d '{...}'`."""
    body = json.dumps({"model": model_id, "prompt": "Hi", "stream": False, "options": GREEDY})
    sent = httpx.post(f"{server.url}/api/generate", content=body, timeout=60, headers={
        **AUTH, "Content-Type": "application/x-www-form-urlencoded"})
    assert sent.status_code == 200 and sent.json()["done"] is True
    # The same body from a web page on another origin (a form's post, which browsers send
    # without asking CORS first): no site the user visits may make the server generate.
    for labelled in ({"Content-Type": "text/plain"}, {}):  # {}: a no-cors fetch of a Blob
        sent = httpx.post(f"{server.url}/api/generate", content=body, timeout=60, headers={
            **AUTH, **labelled, "Origin": "https://evil.example"})
        assert sent.status_code == 403 and "evil.example" in sent.json()["error"]


def test_a_stream_left_early_ends_its_generation(server: ServerProcess, model_id: str) -> None:
    body = {"model": model_id, "messages": HI, "options": {"num_predict": 2000,
                                                           "temperature": 0}}
    with httpx.stream("POST", f"{server.url}/api/chat", json=body, headers=AUTH,
                      timeout=60) as response:
        assert response.headers["content-type"] == "application/x-ndjson"
        first = json.loads(next(response.iter_lines()))
    assert first["done"] is False and first["model"] == model_id
    for _ in range(100):
        load = httpx.get(f"{server.url}/get_load", headers=AUTH, timeout=10).json()[0]
        if load["num_reqs"] == 0:
            break
    assert load["num_reqs"] == 0


@pytest.mark.parametrize(("path", "body", "status", "message"), [
    ("/api/chat", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages.0.role: Input should be"),
    ("/api/chat", {"messages": HI, "options": {"temperature": "hot"}}, 400,
     "options.temperature"),
    ("/api/chat", {"messages": [{"role": "user", "content": "x", "images": ["bm90IGFu"]}]},
     400, "not a base64 PNG, JPEG"),
    ("/api/chat", {"messages": [{"role": "user", "content": "x", "images": [PNG]}]}, 400,
     "does not read images"),
    ("/api/generate", {"prompt": "x", "suffix": "y"}, 400, "does not support insert"),
    ("/api/embed", {"input": ["x", ""]}, 400, "input[1] is empty"),
    # As many as /v1/embeddings takes: 200,000 held the engine 30 s, answered in 265 MB.
    ("/api/embed", {"input": ["x"] * 2049}, 400, "input: List should have at most 2048"),
    ("/api/generate", {"prompt": "x", "raw": True, "system": "s"}, 400, "a raw prompt"),
    ("/api/generate", {"prompt": "[img-0]", "raw": True, "images": [PNG]}, 400,
     "does not read images"),
    # Each one's thinking goes with the assistant message after it: nothing is left.
    ("/api/chat", {"messages": [{"role": "thinking", "content": "x"}]}, 400,
     "only thinking"),
    ("/api/chat", {"model": "no-such-model", "messages": HI}, 404, "no-such-model"),
    ("/api/show", {"model": None}, 400, "model is required"),
])
def test_requests_the_server_cannot_answer_get_ollamas_error(
        server: ServerProcess, model_id: str, path: str, body: dict, status: int,
        message: str) -> None:
    sent = {"model": model_id, "stream": False, **body}
    response = httpx.post(f"{server.url}{path}", json=sent, headers=AUTH, timeout=60)
    assert response.status_code == status, response.text
    assert list(response.json()) == ["error"] and message in response.json()["error"]


@pytest.mark.parametrize(("method", "action"), [
    ("POST", "pull"), ("POST", "push"), ("POST", "create"), ("POST", "copy"),
    ("DELETE", "delete")])
def test_ollamas_model_store_is_a_404_that_says_it_is_not_kept_here(
        olla: ollama.Client, server: ServerProcess, model_id: str, method: str,
        action: str) -> None:
    """`ollama pull` printed "Error: Not Found", as a wrong URL gets."""
    response = httpx.request(method, f"{server.url}/api/{action}", json={"model": model_id},
                             headers=AUTH, timeout=30)
    assert response.status_code == 404
    assert "model store" in response.json()["error"] and model_id in response.json()["error"]
    with pytest.raises(ollama.ResponseError) as pulled:
        olla.pull(model_id)
    assert pulled.value.status_code == 404 and "model store" in pulled.value.error


@pytest.mark.parametrize(("value", "message"), [
    (["a", 1], "input.1: Input should be a valid string"),
    ({"text": "x"}, "input: must be a string or a list of strings"),
])
def test_an_embed_input_of_the_wrong_shape_gets_one_error(
        server: ServerProcess, model_id: str, value: object, message: str) -> None:
    """Not one error per member of the union the field's type is."""
    response = httpx.post(f"{server.url}/api/embed", json={"model": model_id, "input": value},
                          headers=AUTH, timeout=60)
    assert (response.status_code, response.json()) == (400, {"error": message})


def test_thinking_comes_apart_from_the_answer(thinking_server: ServerProcess) -> None:
    olla = ollama.Client(host=thinking_server.url)
    [model] = olla.list().models
    assert "thinking" in olla.show(model.model).capabilities
    reply = olla.chat(model=model.model, messages=HI, think=True,
                      options={"num_predict": 40, "seed": 1})
    assert reply.message.thinking and "<think>" not in reply.message.content


def test_continues_thinking_messages_are_the_next_assistant_messages_thinking(
        thinking_server: ServerProcess) -> None:
    """Continue sends a reply's thinking back as a message of its own, role "thinking",
    before the assistant message (its Ollama provider passes its roles through): Ollama
    takes any role; here it is that assistant message's thinking, which a template that
    shows a turn's reasoning renders (and the prefix cache finds). It was a 400."""
    olla = ollama.Client(host=thinking_server.url)
    [model] = olla.list().models
    # A reply to continue: its turn comes after the last user message, so its template
    # shows its thinking.
    turns = [{"role": "thinking", "content": "The user wants a greeting."},
             {"role": "assistant", "content": "Hi"}]
    folded = [{"role": "assistant", "content": "Hi", "thinking": turns[0]["content"]}]

    def prompt_tokens(messages: list[dict]) -> int:
        reply = httpx.post(f"{thinking_server.url}/api/chat", timeout=60, json={
            "model": model.model, "messages": HI + messages, "stream": False,
            "options": {"num_predict": 1}})
        assert reply.status_code == 200, reply.text
        return reply.json()["prompt_eval_count"]

    sent = prompt_tokens(turns)
    assert sent == prompt_tokens(folded) > prompt_tokens(turns[1:])


# A template of harmony's shape (gpt-oss's): its reasoning effort in a system turn.
HARMONY = ("<|start|>system<|message|>Reasoning: {{ reasoning_effort }}<|end|>"
           "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}"
           "<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")


def test_think_max_is_high_to_a_harmony_template(
        demo_model_dir: Path, tmp_path: Path) -> None:
    """gpt-oss's Reasoning line knows low, medium and high: Ollama asks a harmony
    template (its tags) for "high" where `think` says "max" (routes.go), on /api/chat and
    /api/generate alike; "max" reached the template as it was."""
    model = build_thinking_model(demo_model_dir, tmp_path / "tiny-harmony")
    template = tmp_path / "harmony.jinja"
    template.write_text(HARMONY)
    server = start_server(model, tmp_path / "server.log", "--chat-template", str(template))

    def prompt_tokens(path: str, think: str) -> int:
        body = {"model": model.name, "think": think, "stream": False,
                "options": {"num_predict": 1}, **({"messages": HI} if path == "chat"
                                                  else {"prompt": HI[0]["content"]})}
        reply = httpx.post(f"{server.url}/api/{path}", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()["prompt_eval_count"]

    try:
        counts = {(path, think): prompt_tokens(path, think) for path in ("chat", "generate")
                  for think in ("high", "max")}
    finally:
        server.stop()
    tokenizer = load_tokenizer(model, HARMONY)
    high = len(tokenizer.chat_prompt(HI, variables={"reasoning_effort": "high"}))
    assert high != len(tokenizer.chat_prompt(HI, variables={"reasoning_effort": "max"}))
    assert set(counts.values()) == {high}


@pytest.mark.parametrize("path", ["chat", "generate"])
def test_thinking_asked_of_a_model_that_does_not_reason_is_ollamas_400(
        server: ServerProcess, model_id: str, path: str) -> None:
    """Ollama refuses `think` a model cannot honour rather than answer without it."""
    body = {"model": model_id, "think": True, "stream": False,
            "options": {"num_predict": 2}, **({"messages": HI} if path == "chat" else
                                               {"prompt": "hi"})}
    response = httpx.post(f"{server.url}/api/{path}", json=body, headers=AUTH, timeout=60)
    assert (response.status_code, response.json()) == (
        400, {"error": f'"{model_id}" does not support thinking'})


def test_a_conversation_with_tool_calls_renders_as_chat_templates_take_it() -> None:
    """Ollama's calls have no ids: each gets one of its place, so a conversation sent again
    renders (and hits the cache) alike; a tool's result answers its tool's latest call."""
    body = ChatRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "Weather in Paris and Rome?", "images": [PNG]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "weather", "arguments": {"city": "Paris"}}},
            {"function": {"name": "time", "arguments": {}}}]},
        {"role": "tool", "tool_name": "weather", "content": "Sunny."},
        {"role": "tool", "content": "Noon."}]})
    request = chat_request(body)
    user, assistant, weather, clock = request.messages
    assert user["content"] == MARKER + "Weather in Paris and Rome?"
    assert request.images == (f"data:image/png;base64,{PNG}",)
    assert [call["id"] for call in assistant["tool_calls"]] == ["call_1_0", "call_1_1"]
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert (weather["tool_call_id"], weather["name"]) == ("call_1_0", "weather")
    assert clock["tool_call_id"] == "call_1_1"
    assert chat_request(body) == request
    # A result that names its call by the id Ollama gave it answers that call.
    with_ids = ChatRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_p", "function": {"name": "weather", "arguments": {"city": "Paris"}}},
            {"id": "call_r", "function": {"name": "weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_name": "weather", "tool_call_id": "call_p", "content": "Sun"},
        {"role": "tool", "tool_name": "weather", "tool_call_id": "call_r", "content": "Rain"}]})
    paris, rome = chat_request(with_ids).messages[2:]
    assert (paris["tool_call_id"], rome["tool_call_id"]) == ("call_1_0", "call_1_1")
    assert image_url("data:image/jpeg;base64,/9j/", "images.0") == "data:image/jpeg;base64,/9j/"


def test_options_left_out_sample_as_ollamas_defaults_under_the_models_own() -> None:
    """A request without options samples as Ollama's do (temperature 0.8, top_k 40, top_p
    0.9), a model's own defaults (its table's `sampling`, as a Modelfile's parameters)
    still taking their place; it sampled the whole vocabulary at temperature 1."""
    request = generate_request(GenerateRequest.model_validate({"model": "m", "prompt": "Hi"}))
    sampling = request.sampling
    assert (sampling.temperature, sampling.top_k, sampling.top_p) == (0.8, 40, 0.9)
    assert {"temperature", "top_k", "top_p"} <= request.unset_sampling
    chosen = chat_request(ChatRequest.model_validate({
        "model": "m", "messages": HI, "options": {"temperature": 0.2, "top_k": 0}}))
    assert (chosen.sampling.temperature, chosen.sampling.top_k) == (0.2, 0)
    assert "temperature" not in chosen.unset_sampling


def test_integer_options_sent_as_json_floats_are_taken_as_ollamas_go_takes_them() -> None:
    """Ollama reads a request's options as Go reads JSON numbers, float64s, and makes
    an integer option an integer by truncating one (api.Options.FromMap): 128.0 is 128,
    40.7 is 40. They were 400s here."""
    options = {"num_predict": 128.0, "top_k": 40.7, "seed": 7.0, "num_keep": 5.0}
    request = generate_request(GenerateRequest.model_validate(
        {"model": "m", "prompt": "Hi", "options": options}))
    assert request.max_tokens == 128
    assert (request.sampling.top_k, request.sampling.seed) == (40, 7)
    assert GenerateRequest.model_validate(  # num_keep is read where a prompt is cut
        {"model": "m", "options": options}).options.num_keep == 5
    for wrong in ({"top_k": True}, {"num_predict": "128"}):
        with pytest.raises(ValidationError):
            GenerateRequest.model_validate({"model": "m", "options": wrong})


@pytest.mark.parametrize(("options", "looked_at"), [
    ({}, 64), ({"repeat_last_n": 128}, 128), ({"repeat_last_n": -1}, -1),
    ({"repeat_last_n": 0}, 0)])
def test_repeat_last_n_is_how_far_back_the_repeat_penalty_looks(
        options: dict, looked_at: int) -> None:
    """Ollama's repeat_penalty looks at the last repeat_last_n tokens (64 unless said, -1
    the whole context, 0 none), as llama.cpp's sampler it hands both to; it was ignored,
    and the penalty looked at 20."""
    request = chat_request(ChatRequest.model_validate(
        {"model": "m", "messages": HI, "options": {"repeat_penalty": 1.2, **options}}))
    assert request.sampling.repetition_context == looked_at
    with pytest.raises(ValidationError, match="repeat_last_n"):
        ChatRequest.model_validate({"model": "m", "options": {"repeat_last_n": -2}})


@pytest.mark.parametrize("level", ["low", "medium", "high", "max"])
def test_think_levels_are_ollamas_max_included(level: str) -> None:
    """Ollama takes `think` as a boolean or a level, "max" among them since its 0.21.3
    (api.ThinkValue); a level reaches the template as its reasoning effort. "max" was a
    400 here."""
    request = chat_request(ChatRequest.model_validate(
        {"model": "m", "messages": HI, "think": level}))
    assert request.chat_template_kwargs == {"enable_thinking": True,
                                            "reasoning_effort": level}


def test_tool_calls_come_whole_with_their_arguments_as_objects() -> None:
    """Ollama's calls are objects, sent once whole (its clients do not add up fragments),
    numbered; text and thinking stream as they come."""
    events = [ReasoningDelta(0, "Weather, then time."), TextDelta(0, "Checking."),
              ToolCallStarted(0, 0, "call_a", "weather"),
              ToolCallArguments(0, 0, '{"city": '), ToolCallArguments(0, 0, '"Paris"}'),
              ToolCallStarted(0, 1, "call_b", "time"),
              ChoiceFinished(0, "tool_calls", Usage(prompt_tokens=20, completion_tokens=9))]
    reply = OllamaReply("m", Clock(), chat=True)
    objects = [out for event in events for out in reply.objects(event)]
    assert [(o.message.thinking, o.message.content) for o in objects[:2]] == [
        ("Weather, then time.", ""), (None, "Checking.")]
    assert [o.message.tool_calls[0].function for o in objects[2:4]] == [
        {"index": 0, "name": "weather", "arguments": {"city": "Paris"}},
        {"index": 1, "name": "time", "arguments": {}}]
    # Ollama's calls have ids now, which its clients send back as tool_call_id.
    assert [o.message.tool_calls[0].id for o in objects[2:4]] == ["call_a", "call_b"]
    last = objects[-1]
    assert (last.done, last.done_reason, last.prompt_eval_count, last.eval_count) == (
        True, "stop", 20, 9)
    merged = whole(objects).message
    assert (merged.content, merged.thinking, len(merged.tool_calls)) == (
        "Checking.", "Weather, then time.", 2)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "generate"])
def test_a_text_line_is_the_object_it_stands_for(chat: bool) -> None:
    """Text lines are written into an envelope, not dumped from the models: the same JSON
    but for the time they were stamped."""
    reply = OllamaReply("m", Clock(), chat=chat)
    for text in ("Hello", ' "quoted" \\ \n', "\u2028 é 😀", "\x00text\x00"):
        event = TextDelta(0, text)
        [line] = reply.lines(event)
        [dumped] = [out.model_dump_json(exclude_none=True) for out in reply.objects(event)]
        line_object, dumped_object = json.loads(line), json.loads(dumped)
        assert line_object.pop("created_at").endswith("Z")
        dumped_object.pop("created_at")
        assert line_object == dumped_object


@pytest.mark.parametrize(("count", "written"), [
    (134_515_008, "134.52M"), (7_615_616_512, "7.6B"), (8_000_000_000, "8B"),
    (2_000_000, "2M"), (336_192, "336K"), (999, "999")])
def test_a_parameter_count_is_written_as_ollamas(count: int, written: str) -> None:
    assert human_number(count) == written


@pytest.mark.parametrize(("path", "body"), [
    ("/api/chat", {"messages": HI}), ("/api/generate", {"prompt": "Say hi."})])
def test_the_openapi_schema_declares_ollamas_streams(
        server: ServerProcess, model_id: str, path: str, body: dict) -> None:
    """Ollama streams unless told not to: its JSON lines are what the schema's 200 says,
    each line a chunk of the declared shape (schemathesis flagged them as undeclared)."""
    declared = httpx.get(f"{server.url}/openapi.json", headers=AUTH, timeout=10).json()
    content = declared["paths"][path]["post"]["responses"]["200"]["content"]
    with httpx.stream("POST", f"{server.url}{path}", headers=AUTH, timeout=60,
                      json={"model": model_id, "options": GREEDY, **body}) as response:
        kind = response.headers["content-type"].split(";")[0]
        assert kind in content, (kind, list(content))
        for line in response.iter_lines():
            jsonschema.validate(json.loads(line), content[kind]["schema"])
