"""LM Studio's own REST API (/api/v0) on a real server of several models: each endpoint's
documented example request (lmstudio.ai/docs/developer/rest/endpoints), answered with
the fields its docs show, by the same engines as the OpenAI routes."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.model_source import default_model_file
from tests.server.support import API_KEY, ServerProcess, start_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL_FIELDS = {"id", "object", "type", "publisher", "arch", "compatibility_type",
                "quantization", "state", "max_context_length", "capabilities"}
STATS = {"tokens_per_second", "time_to_first_token", "generation_time", "stop_reason"}
# The docs' example chat, on our model, greedy so that /v1 gives the same answer.
RHYMES = {"model": "tiny", "messages": [
    {"role": "system", "content": "Always answer in rhymes."},
    {"role": "user", "content": "Introduce yourself."}], "temperature": 0,
    "max_tokens": -1, "stream": False}


@pytest.fixture(scope="module")
def studio(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    """The demo model (`tiny`, with an alias), a copy of it (`spare`) that nothing loads,
    and the default GGUF (`smol`), listed but never loaded here."""
    directory = tmp_path_factory.mktemp("lmstudio")
    spare = shutil.copytree(demo_model_dir, directory / "publisher" / "spare")
    models = directory / "models.toml"
    models.write_text("".join(
        "[[models]]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in table.items())
        for table in [{"id": "tiny", "source": str(demo_model_dir), "aliases": ["tiny-alias"]},
                      {"id": "spare", "source": str(spare)},
                      {"id": "smol", "source": str(default_model_file())}]))
    server = start_server(None, directory / "server.log", "--models-file", str(models),
                          "--api-key", API_KEY)
    yield server
    server.stop()


def get(server: ServerProcess, path: str) -> httpx.Response:
    return httpx.get(f"{server.url}{path}", headers=AUTH, timeout=60)


def post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=300)


def test_every_model_is_listed_loaded_or_not_as_lm_studio_describes_it(
        studio: ServerProcess) -> None:
    listed = get(studio, "/api/v0/models").json()
    assert listed["object"] == "list"
    models = {entry["id"]: entry for entry in listed["data"]}
    assert set(models) == {"tiny", "tiny-alias", "spare", "smol"}
    assert all(set(entry) == MODEL_FIELDS and entry["object"] == "model"
               for entry in models.values())
    spare = models["spare"]
    assert (spare["type"], spare["arch"], spare["compatibility_type"]) == ("llm", "llama", "mlx")
    assert (spare["state"], spare["publisher"], spare["quantization"]) == (
        "not-loaded", "publisher", "F32")
    assert spare["max_context_length"] > 0 and spare["capabilities"] == ["tool_use"]
    # A GGUF source is LM Studio's gguf, whatever it is converted to as it loads.
    assert (models["smol"]["compatibility_type"], models["smol"]["state"]) == (
        "gguf", "not-loaded")
    assert post(studio, "/api/v0/chat/completions", {**RHYMES, "max_tokens": 1}).is_success
    tiny = get(studio, "/api/v0/models/tiny").json()
    assert tiny == get(studio, "/api/v0/models").json()["data"][0]
    assert tiny == {**models["tiny"], "state": "loaded"}
    assert get(studio, "/api/v0/models/spare").json()["state"] == "not-loaded"


def test_an_unknown_model_is_lm_studios_404(studio: ServerProcess) -> None:
    """LM Studio's errors are OpenAI's error object, though its API shares Ollama's /api."""
    for response in (get(studio, "/api/v0/models/no-such-model"),
                     post(studio, "/api/v0/chat/completions",
                          {**RHYMES, "model": "no-such-model"})):
        assert response.status_code == 404
        error = response.json()["error"]
        assert (error["type"], error["param"], error["code"]) == (
            "invalid_request_error", "model", "model_not_found")
        assert "no-such-model" in error["message"]


def test_a_chat_is_openais_answer_with_lm_studios_stats(studio: ServerProcess) -> None:
    # Warm the prompt first, so that both answers read it from the cache alike and their
    # usage (cached tokens included) can be compared whatever ran before this test.
    assert post(studio, "/v1/chat/completions", {**RHYMES, "max_tokens": 1}).is_success
    answer = post(studio, "/api/v0/chat/completions", RHYMES).json()
    assert answer["object"] == "chat.completion" and answer["model"] == "tiny"
    openai = post(studio, "/v1/chat/completions", {**RHYMES, "max_tokens": None}).json()
    assert answer["choices"] == openai["choices"] and answer["usage"] == openai["usage"]
    stats = answer["stats"]
    # Without a limit the reply runs until the model ends it (or the context window does).
    ended = {"length": "maxPredictedTokensReached", "stop": "eosFound"}
    assert set(stats) == STATS
    assert stats["stop_reason"] == ended[answer["choices"][0]["finish_reason"]]
    assert 0 < stats["time_to_first_token"] and 0 < stats["generation_time"]
    completion_tokens = answer["usage"]["completion_tokens"]
    assert stats["tokens_per_second"] == pytest.approx(
        completion_tokens / stats["generation_time"])
    listed = get(studio, "/api/v0/models/tiny").json()
    assert answer["model_info"] == {"arch": "llama", "quant": listed["quantization"],
                                    "format": "mlx",
                                    "context_length": listed["max_context_length"]}
    assert answer["runtime"]["name"] == "radix-mlx"
    assert answer["runtime"]["supported_formats"] == ["safetensors", "gguf"]


def test_the_stop_reason_says_why_the_reply_ended(studio: ServerProcess) -> None:
    def stop_reason(**extra) -> str:
        body = {**RHYMES, "max_tokens": 6, **extra}
        return post(studio, "/api/v0/chat/completions", body).json()["stats"]["stop_reason"]

    text = post(studio, "/api/v0/chat/completions", {**RHYMES, "max_tokens": 6}).json()[
        "choices"][0]["message"]["content"]
    assert stop_reason() == "maxPredictedTokensReached"
    assert stop_reason(stop=[text.split()[-1]]) == "stopStringFound"
    tools = [{"type": "function", "function": {"name": "rhyme", "parameters": {
        "type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}]
    assert stop_reason(tools=tools, tool_choice="required", max_tokens=-1) == "toolCalls"


def test_a_completion_is_openais_answer_with_lm_studios_stats(studio: ServerProcess) -> None:
    example = {"model": "tiny", "prompt": "the meaning of life is", "temperature": 0.7,
               "max_tokens": 10, "stream": False, "stop": "\n"}
    answer = post(studio, "/api/v0/completions", example).json()
    assert answer["object"] == "text_completion" and len(answer["choices"]) == 1
    assert answer["usage"]["completion_tokens"] <= 10
    assert set(answer["stats"]) == STATS
    assert answer["stats"]["stop_reason"] in {"maxPredictedTokensReached", "stopStringFound"}
    assert set(answer["model_info"]) == {"arch", "quant", "format", "context_length"}
    # Greedy, so that the answer is fixed: sampled, the demo model ended within 10
    # tokens now and then.
    unlimited = post(studio, "/api/v0/completions",
                     {**example, "max_tokens": -1, "stop": [], "temperature": 0})
    assert unlimited.json()["usage"]["completion_tokens"] > 10


def test_embeddings_are_openais(studio: ServerProcess) -> None:
    example = {"model": "tiny", "input": "Some text to embed"}
    answer = post(studio, "/api/v0/embeddings", example).json()
    openai = post(studio, "/v1/embeddings", example).json()
    assert answer["data"] == openai["data"] and answer["model"] == "tiny"
    assert answer["usage"]["prompt_tokens"] == openai["usage"]["prompt_tokens"]
    assert answer["object"] == "list" and answer["data"][0]["object"] == "embedding"


def test_a_stream_is_openais_chunks(studio: ServerProcess) -> None:
    """LM Studio streams its chat as OpenAI's chunks, without its stats."""
    body = {**RHYMES, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{studio.url}/api/v0/chat/completions", json=body,
                      headers=AUTH, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        data = [line.removeprefix("data: ") for line in response.iter_lines()
                if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(chunk) for chunk in data[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    whole = post(studio, "/api/v0/chat/completions", {**body, "stream": False}).json()
    assert "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks) == (
        whole["choices"][0]["message"]["content"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# -- v1: LM Studio 0.4's model management ---------------------------------------------------


def test_v1_lists_each_model_with_its_loaded_instance(studio: ServerProcess,
                                                      demo_model_dir: Path) -> None:
    models = {entry["key"]: entry for entry in get(studio, "/api/v1/models").json()["models"]}
    assert set(models) == {"tiny", "spare", "smol"}
    spare = models["spare"]
    weights = sum(path.stat().st_size for path in demo_model_dir.glob("*.safetensors"))
    assert spare == {
        "type": "llm", "publisher": "publisher", "key": "spare", "display_name": "spare",
        "quantization": {"name": "F32", "bits_per_weight": 32}, "size_bytes": weights,
        "params_string": spare["params_string"], "loaded_instances": [],
        "max_context_length": spare["max_context_length"], "format": "mlx",
        "architecture": "llama",
        "capabilities": {"vision": False, "trained_for_tool_use": True}, "description": None}
    assert spare["params_string"] and spare["max_context_length"] > 0
    smol = models["smol"]
    assert (smol["format"], smol["size_bytes"]) == ("gguf", default_model_file().stat().st_size)


def test_v1_loads_and_unloads_a_model(studio: ServerProcess) -> None:
    def instances() -> list[dict]:
        listed = get(studio, "/api/v1/models").json()["models"]
        return next(entry for entry in listed if entry["key"] == "spare")["loaded_instances"]

    loaded = post(studio, "/api/v1/models/load",
                  {"model": "spare", "context_length": 16384, "flash_attention": True,
                   "echo_load_config": True}).json()
    context = get(studio, "/api/v0/models/spare").json()["max_context_length"]
    assert loaded == {"type": "llm", "instance_id": "spare", "status": "loaded",
                      "load_time_seconds": loaded["load_time_seconds"],
                      "load_config": {"context_length": context}}
    assert instances() == [{"id": "spare", "config": {"context_length": context}}]
    assert "load_config" not in post(studio, "/api/v1/models/load", {"model": "spare"}).json()
    assert post(studio, "/api/v1/models/unload", {"instance_id": "spare"}).json() == {
        "instance_id": "spare"}
    assert instances() == []
    assert get(studio, "/api/v0/models/spare").json()["state"] == "not-loaded"


def test_v1_errors_are_v1s(studio: ServerProcess, server: ServerProcess) -> None:
    missing = post(studio, "/api/v1/models/unload", {"instance_id": "no-such-model"})
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "model_not_found"
    unnamed = post(studio, "/api/v1/models/load", {})
    assert unnamed.status_code == 400
    assert unnamed.json()["error"]["type"] == "invalid_request"
    assert unnamed.json()["error"]["param"] == "model"
    # The one model of a server of one stays loaded.
    kept = post(server, "/api/v1/models/unload", {"instance_id": server_model(server)})
    assert kept.status_code == 409 and kept.json()["error"]["type"] == "invalid_request"


# The docs' example chat as v1's request: the system prompt and one turn of text.
V1_RHYMES = {"model": "tiny", "system_prompt": "Always answer in rhymes.",
             "input": "Introduce yourself.", "temperature": 0, "max_output_tokens": 8}


def openais_reply(server: ServerProcess, messages: list[dict]) -> dict:
    return post(server, "/v1/chat/completions", {
        "model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 8}).json()


def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event, data) of each named event of a stream."""
    events, name = [], None
    for line in response.text.splitlines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            events.append((name, json.loads(line.removeprefix("data: "))))
    return events


def test_v1_chat_is_the_models_reply_as_lm_studios_output_and_stats(
        studio: ServerProcess) -> None:
    """POST /api/v1/chat (lmstudio.ai/docs/developer/rest/chat): the same greedy reply as
    /v1/chat/completions to the same conversation, as a message item, with its token
    counts and timings, and the id it is stored under."""
    messages = [{"role": "system", "content": V1_RHYMES["system_prompt"]},
                {"role": "user", "content": V1_RHYMES["input"]}]
    openai = openais_reply(studio, messages)
    answer = post(studio, "/api/v1/chat", V1_RHYMES)
    assert answer.status_code == 200, answer.text
    result = answer.json()
    assert set(result) == {"model_instance_id", "output", "stats", "response_id"}
    assert result["model_instance_id"] == "tiny"
    assert result["output"] == [{"type": "message",
                                 "content": openai["choices"][0]["message"]["content"]}]
    stats = result["stats"]
    assert (stats["input_tokens"], stats["total_output_tokens"]) == (
        openai["usage"]["prompt_tokens"], openai["usage"]["completion_tokens"])
    assert stats["reasoning_output_tokens"] == 0
    assert stats["time_to_first_token_seconds"] > 0 and stats["tokens_per_second"] > 0
    assert result["response_id"].startswith("resp_")


def test_v1_chat_continues_the_stored_chat_its_previous_response_id_names(
        studio: ServerProcess) -> None:
    """Stateful as LM Studio's: the next turn sends only itself, and is answered as the
    whole conversation would be; store false keeps nothing; an unknown id is a 404."""
    first = post(studio, "/api/v1/chat", V1_RHYMES).json()
    follow_up = post(studio, "/api/v1/chat", {
        "model": "tiny", "input": "Once more, shorter.", "temperature": 0,
        "max_output_tokens": 8, "previous_response_id": first["response_id"]}).json()
    openai = openais_reply(studio, [
        {"role": "system", "content": V1_RHYMES["system_prompt"]},
        {"role": "user", "content": V1_RHYMES["input"]},
        {"role": "assistant", "content": first["output"][0]["content"]},
        {"role": "user", "content": "Once more, shorter."}])
    assert follow_up["output"][0]["content"] == openai["choices"][0]["message"]["content"]
    assert follow_up["stats"]["input_tokens"] == openai["usage"]["prompt_tokens"]
    assert follow_up["response_id"] not in (None, first["response_id"])
    unstored = post(studio, "/api/v1/chat", {**V1_RHYMES, "store": False}).json()
    assert "response_id" not in unstored
    missing = post(studio, "/api/v1/chat", {**V1_RHYMES, "previous_response_id": "resp_x"})
    assert missing.status_code == 404
    assert missing.json()["error"]["param"] == "previous_response_id"


def test_v1_chat_streams_lm_studios_events(studio: ServerProcess) -> None:
    """stream: true is LM Studio's named events, chat.start first and chat.end last with
    the whole result; the message's deltas make its content."""
    whole = post(studio, "/api/v1/chat", {**V1_RHYMES, "store": False}).json()
    streamed = post(studio, "/api/v1/chat", {**V1_RHYMES, "store": False, "stream": True})
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed)
    assert all(name == data["type"] for name, data in events)
    names = [name for name, _ in events]
    deltas = names.count("message.delta")
    assert deltas > 0 and names == [
        "chat.start", "prompt_processing.start", "prompt_processing.end", "message.start",
        *["message.delta"] * deltas, "message.end", "chat.end"]
    assert events[0][1] == {"type": "chat.start", "model_instance_id": "tiny"}
    result = events[-1][1]["result"]
    assert result["output"] == whole["output"]
    assert "".join(data["content"] for name, data in events if name == "message.delta") \
        == whole["output"][0]["content"]
    assert result["stats"]["total_output_tokens"] == whole["stats"]["total_output_tokens"]


def test_v1_chat_says_when_it_loaded_its_model(studio: ServerProcess) -> None:
    """A chat whose model was not loaded says how long the load took: its stats'
    model_load_time_seconds and, streamed, model_load.start and model_load.end between
    chat.start and prompt processing. A chat on a loaded model has neither."""
    body = {**V1_RHYMES, "model": "spare", "store": False}

    def unload() -> None:
        post(studio, "/api/v1/models/unload", {"instance_id": "spare"})

    unload()
    try:
        whole = post(studio, "/api/v1/chat", body).json()
        assert whole["stats"]["model_load_time_seconds"] > 0
        unload()
        events = sse_events(post(studio, "/api/v1/chat", {**body, "stream": True}))
        assert [name for name, _ in events[:4]] == [
            "chat.start", "model_load.start", "model_load.end", "prompt_processing.start"]
        assert events[1][1] == {"type": "model_load.start", "model_instance_id": "spare"}
        seconds = events[2][1]["load_time_seconds"]
        assert seconds > 0 and events[2][1]["model_instance_id"] == "spare"
        assert events[-1][1]["result"]["stats"]["model_load_time_seconds"] == seconds
        loaded = sse_events(post(studio, "/api/v1/chat", {**body, "stream": True}))
        assert not [name for name, _ in loaded if name.startswith("model_load")]
        assert "model_load_time_seconds" not in loaded[-1][1]["result"]["stats"]
    finally:
        unload()


def test_a_v1_chat_stream_says_its_model_is_loading_before_the_load_ends(
        studio: ServerProcess) -> None:
    """chat.start and model_load.start come at once, not with model_load.end: a client
    shows the load as it happens, and no read timeout fires on a silent stream."""
    post(studio, "/api/v1/models/unload", {"instance_id": "spare"})
    body = {**V1_RHYMES, "model": "spare", "store": False, "stream": True}
    names, loaded_at_start = [], None
    try:
        with httpx.stream("POST", f"{studio.url}/api/v1/chat", json=body, headers=AUTH,
                          timeout=300) as response:
            for line in response.iter_lines():
                if not line.startswith("event: "):
                    continue
                names.append(line.removeprefix("event: "))
                if names[-1] == "model_load.start":
                    listed = get(studio, "/api/v1/models").json()["models"]
                    loaded_at_start = next(entry for entry in listed
                                           if entry["key"] == "spare")["loaded_instances"]
        assert names[:4] == ["chat.start", "model_load.start", "model_load.end",
                             "prompt_processing.start"]
        assert names.count("chat.start") == names.count("model_load.start") == 1
        assert names[-1] == "chat.end" and loaded_at_start == []
    finally:
        post(studio, "/api/v1/models/unload", {"instance_id": "spare"})


def test_v1_chat_gives_reasoning_its_own_item(thinking_server: ServerProcess) -> None:
    """A thinking model's reasoning is a reasoning item (and its events), counted apart,
    never inside the message; the stored turn keeps it, and the chat goes on from it."""
    model = server_model(thinking_server)
    body = {"model": model, "input": "Which city is the capital of France?",
            "reasoning": "on", "temperature": 0, "max_output_tokens": 24}
    result = post(thinking_server, "/api/v1/chat", body).json()
    assert result["output"][0]["type"] == "reasoning" and result["output"][0]["content"]
    assert all("<think>" not in item["content"] for item in result["output"])
    assert 0 < result["stats"]["reasoning_output_tokens"] <= result["stats"][
        "total_output_tokens"]
    events = sse_events(post(thinking_server, "/api/v1/chat",
                             {**body, "stream": True, "store": False}))
    names = [name for name, _ in events]
    assert names.index("reasoning.start") < names.index("reasoning.end")
    assert "".join(data["content"] for name, data in events if name == "reasoning.delta") \
        == result["output"][0]["content"]
    follow_up = post(thinking_server, "/api/v1/chat", {
        **body, "input": "And of Italy?", "previous_response_id": result["response_id"]})
    assert follow_up.status_code == 200, follow_up.text
    assert follow_up.json()["stats"]["input_tokens"] > result["stats"]["input_tokens"]


@pytest.mark.parametrize(("body", "param"), [
    ({"integrations": ["mcp/playwright"]}, "integrations"),
    ({"reasoning": "high"}, "reasoning"),
    ({"input": []}, "input"),
    ({"input": [{"type": "image", "data_url": "https://example.com/a.png"}]},
     "input[0].data_url"),
    ({"input": [{"type": "video", "content": "a"}]}, "input"),
    ({"input": {"text": "a"}}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    # The pipeline's refusal, named as v1 names the field.
    ({"input": "word " * 200, "context_length": 64}, "input"),
])
def test_what_v1_chat_cannot_serve_is_a_400_in_v1s_shape(
        studio: ServerProcess, body: dict, param: str) -> None:
    response = post(studio, "/api/v1/chat", {**V1_RHYMES, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request" and error["message"]
    assert error["param"].startswith(param), error
    # One error for the shape sent, not one for each shape input may take.
    assert "tagged-union" not in error["message"] and "input.str" not in error["message"]


def server_model(server: ServerProcess) -> str:
    return get(server, "/api/v1/models").json()["models"][0]["key"]


def test_the_default_model_is_the_gguf_it_was_converted_from(real_server: ServerProcess
                                                             ) -> None:
    """Served from the directory its GGUF was converted to as it loaded, the default model
    is still LM Studio's gguf (and Ollama's), its publisher unknown: not the name of the
    conversion's cache folder; and its size is the GGUF's, not the float32 conversion's
    (5.5x it)."""
    listed = get(real_server, "/api/v0/models").json()["data"][0]
    assert (listed["compatibility_type"], listed["publisher"]) == ("gguf", "")
    tags = get(real_server, "/api/tags").json()["models"][0]
    assert tags["details"]["format"] == "gguf"
    gguf_bytes = default_model_file().stat().st_size
    assert tags["size"] == gguf_bytes
    [studio] = get(real_server, "/api/v1/models").json()["models"]
    assert studio["size_bytes"] == gguf_bytes
