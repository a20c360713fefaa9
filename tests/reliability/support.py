"""Server processes for the reliability tests, with the environment they need (the fault
token), and what the tests read from them afterwards."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
from tokenizers import Tokenizer

from engine.api import EngineConfig
from engine.engine import WARMUP_PROMPT_TOKENS, Engine
from server.app import create_app
from server.config import Settings
from server.model_registry import ModelRegistry
from tests.server.support import ServerProcess, start_server

API_KEY = "reliability-key-7f3a9c"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Small enough that a few dozen requests overflow it, so eviction runs during the storm.
CACHE_BYTES = 2 * 2**20
MAX_BODY_BYTES = 256 * 1024
HEAD_TIMEOUT = 3.0  # seconds the hardened server waits for a request's head
WRITE_TIMEOUT = 1.0  # seconds it waits for a client to take any of a response


def app_schema() -> dict[str, Any]:
    """The OpenAPI document the server serves at /openapi.json, built in this process."""
    engine = Engine(EngineConfig(model="unused"))  # never started: the schema needs no model
    return create_app(Settings(), ModelRegistry.of_one(Settings(), engine)).openapi()


def server_command(model: Path | str, port: int, *flags: str) -> list[str]:
    return [
        sys.executable, "-m", "server", "--model", str(model), "--port", str(port),
        "--config", "", "--api-key", API_KEY, "--disk-cache-bytes", "0", *flags,
    ]


def launch(model_dir: Path, log_path: Path, *flags: str, env: Mapping[str, str] = {},
           fault_token: int | None = None) -> ServerProcess:
    """A ready server with an API key, its stdout and stderr (the whole log) in `log_path`;
    the caller stops it."""
    return start_server(model_dir, log_path, "--api-key", API_KEY, *flags, env=env,
                        fault_token=fault_token)


def stop(server: ServerProcess) -> None:
    """SIGTERM (the drain), and SIGKILL if that does not end it: nothing outlives a test."""
    try:
        server.stop()
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


def fault_token(model_dir: Path) -> int:
    """A token id that the prompts of these tests never contain: not in the demo corpus
    they are drawn from (nor among the engine's warm-up ids, 1 to 48). Requests that are
    not meant to fail keep the model from generating it with a logit bias."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    corpus = resources.files("engine").joinpath("demo_corpus")
    used = {token for text in corpus.iterdir() if text.name.endswith(".txt")
            for token in tokenizer.encode(text.read_text()).ids}
    return max(set(range(WARMUP_PROMPT_TOKENS + 1, tokenizer.get_vocab_size())) - used)


@dataclass
class Outcome:
    """One request's end as the client saw it: status, the text of choice 0 (whole or
    streamed), and the error object if one came (as the body or as a stream event)."""

    status: int
    text: str = ""
    error: dict[str, Any] | None = None
    finish_reason: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    # Choice 0's tool calls as {"name", "arguments"}, argument fragments joined.
    tool_calls: list[dict[str, str]] = field(default_factory=list)


def choice_text(choice: Mapping[str, Any]) -> str:
    """Choice 0's text in any of the four shapes (chat or legacy, whole or chunk)."""
    if "text" in choice:
        return choice["text"]
    message = choice.get("message") or choice.get("delta") or {}
    return message.get("content") or ""


async def call(client: httpx.AsyncClient, path: str, body: Mapping[str, Any],
               headers: Mapping[str, str] = AUTH) -> Outcome:
    """POST `body`, reading a stream to its end when it asks for one."""
    if not body.get("stream"):
        response = await client.post(path, json=body, headers=headers)
        data = response.json()
        if response.status_code != 200:
            return Outcome(response.status_code, error=data.get("error"),
                           headers=response.headers)
        choice = data["choices"][0]
        outcome = Outcome(200, choice_text(choice), None, choice["finish_reason"],
                          response.headers)
        add_tool_calls(outcome, choice)
        return outcome
    async with client.stream("POST", path, json=body, headers=headers) as response:
        if response.status_code != 200:
            data = json.loads(await response.aread())
            return Outcome(response.status_code, error=data.get("error"),
                           headers=response.headers)
        outcome = Outcome(200, headers=response.headers)
        async for line in response.aiter_lines():
            read_event(outcome, line)
        return outcome


def read_event(outcome: Outcome, line: str) -> None:
    """Add one SSE line's text, finish reason or error to `outcome`."""
    payload = line.removeprefix("data: ")
    if not line.startswith("data: ") or payload == "[DONE]":
        return
    event = json.loads(payload)
    if "error" in event:
        outcome.error = event["error"]
    for choice in event.get("choices", ()):
        outcome.text += choice_text(choice)
        outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
        add_tool_calls(outcome, choice)


def add_tool_calls(outcome: Outcome, choice: Mapping[str, Any]) -> None:
    """Choice 0's tool calls, whole (a message) or in fragments (a delta: the first of a
    call names it, later ones add to its arguments)."""
    message = choice.get("message") or choice.get("delta") or {}
    for position, call in enumerate(message.get("tool_calls") or ()):
        index = call.get("index", position)
        while len(outcome.tool_calls) <= index:
            outcome.tool_calls.append({"name": "", "arguments": ""})
        function = call.get("function") or {}
        outcome.tool_calls[index]["name"] += function.get("name") or ""
        outcome.tool_calls[index]["arguments"] += function.get("arguments") or ""
