"""`--chat-template FILE`: a template of the operator's renders every chat instead of the
model's own, in the server's tokenizer (the engine's process too loads it from the file)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from engine.loader import load_tokenizer
from server.config import ConfigError, load_settings
from server.launch.cli import build_parser
from tests.server.support import ServerProcess, start_server

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.mark.parametrize("engine_process", [False, True])
def test_a_template_file_renders_every_chat(
    demo_model_dir: Path, tmp_path: Path, model_id: str, engine_process: bool
) -> None:
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    flags = ["--chat-template", str(template), *(["--engine-process", "true"]
                                                  if engine_process else [])]
    server = start_server(demo_model_dir, tmp_path / "server.log", *flags)
    try:
        body = {"model": model_id, "system": "Be brief.",
                "messages": [{"role": "user", "content": "Hi"}]}
        counted = httpx.post(f"{server.url}/v1/messages/count_tokens", json=body, timeout=30)
    finally:
        server.stop()
    tokenizer = load_tokenizer(demo_model_dir)
    text = "[system] Be brief.\n[user] Hi\n[assistant] "
    assert counted.json()["input_tokens"] == len(tokenizer.encode(text, special_tokens=False))


def test_a_missing_template_file_stops_the_start(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["serve", "--config", "", "--chat-template", str(tmp_path / "none")])
    with pytest.raises(ConfigError, match="chat_template"):
        load_settings(args, environ={})


def serve_template(model: Path, tmp_path: Path, template: str) -> ServerProcess:
    """A server of `model` rendering chats with `template`."""
    path = tmp_path / "template.jinja"
    path.write_text(template)
    return start_server(model, tmp_path / "server.log", "--chat-template", str(path))


def chat_prompt_tokens(server: ServerProcess, model_id: str, **fields: object) -> int:
    """The prompt tokens of a chat of one user message, "Hi", with `fields`."""
    body = {"model": model_id, "max_tokens": 1,
            "messages": [{"role": "user", "content": "Hi"}], **fields}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    return reply.json()["usage"]["prompt_tokens"]


def test_reasoning_effort_reaches_the_template(
    demo_model_dir: Path, tmp_path: Path, model_id: str
) -> None:
    """OpenAI's reasoning effort (Chat Completions' reasoning_effort, the Responses API's
    reasoning.effort) is the template variable gpt-oss's template reads, as Ollama's
    think levels are; chat_template_kwargs, more particular, still wins."""
    server = serve_template(demo_model_dir, tmp_path, "{% if reasoning_effort is defined %}"
                            "Reasoning: {{ reasoning_effort }}\n{% endif %}" + TEMPLATE)
    tokenizer = load_tokenizer(demo_model_dir)

    def chat(**fields) -> int:
        return chat_prompt_tokens(server, model_id, **fields)

    def response(**fields) -> int:
        return response_input_tokens(server, model_id, **fields)

    try:
        counts = [chat(), chat(reasoning_effort="high"),
                  chat(reasoning_effort="high",
                       chat_template_kwargs={"reasoning_effort": "low, as the operator said"}),
                  response(), response(reasoning={"effort": "high"})]
    finally:
        server.stop()
    plain = len(tokenizer.encode("[user] Hi\n[assistant] ", special_tokens=False))
    high = len(tokenizer.encode("Reasoning: high\n[user] Hi\n[assistant] ",
                                special_tokens=False))
    low = len(tokenizer.encode("Reasoning: low, as the operator said\n[user] Hi\n[assistant] ",
                               special_tokens=False))
    assert counts == [plain, high, low, plain, high]


def test_a_reasoning_effort_turns_thinking_on_or_off_as_vllm_does(
    demo_model_dir: Path, tmp_path: Path, model_id: str
) -> None:
    """vLLM hands a template `reasoning_effort` as written ("minimal" too: gpt-oss's
    harmony path knows only low, medium and high, its Jinja path takes any) and with it
    `enable_thinking`, false for "none" and true otherwise, unless chat_template_kwargs
    says: Qwen3's template then thinks or not as asked. (Unsaid, mlx-lm gives
    enable_thinking as whether the model thinks.) The Responses API's reasoning.effort
    is the same effort."""
    server = serve_template(demo_model_dir, tmp_path, "{% if enable_thinking %}[think]"
                            "{% else %}[answer at once, without thinking]{% endif %}" + TEMPLATE)
    tokenizer = load_tokenizer(demo_model_dir)
    asked = [{"reasoning_effort": "minimal"}, {"reasoning_effort": "none"},
             {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}]
    try:
        counts = [chat_prompt_tokens(server, model_id, **fields) for fields in asked]
        counts += [response_input_tokens(server, model_id, reasoning={"effort": effort})
                   for effort in ("low", "none")]
    finally:
        server.stop()

    def length(text: str) -> int:
        return len(tokenizer.encode(text + "[user] Hi\n[assistant] ", special_tokens=False))
    think, off = length("[think]"), length("[answer at once, without thinking]")
    assert counts == [think, off, think, think, off]


def response_input_tokens(server: ServerProcess, model_id: str, **fields: object) -> int:
    """The input tokens of a Responses input of "Hi", with `fields`."""
    body = {"model": model_id, "input": "Hi", **fields}
    counted = httpx.post(f"{server.url}/v1/responses/input_tokens", json=body, timeout=30)
    return counted.json()["input_tokens"]
