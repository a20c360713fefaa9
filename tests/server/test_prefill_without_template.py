"""A causal model with no chat template (a base model): the prefill endpoints that render
chats say so in their own terms, and the ones that take raw input still work."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.support import ServerProcess, start_server


@pytest.fixture(scope="module")
def base_model_server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                      ) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("base-model")
    model = shutil.copytree(demo_model_dir, directory / "base")
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    server = start_server(model, directory / "server.log")
    yield server
    server.stop()


def post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_rerank_names_the_model_not_a_chat_field(base_model_server: ServerProcess) -> None:
    response = post(base_model_server, "/v1/rerank", {"query": "q", "documents": ["a", "b"]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("model", "model_not_supported")
    assert "chat template" in error["message"] and "/v1/completions" not in error["message"]


def test_classify_takes_input_and_says_so_for_messages(base_model_server: ServerProcess
                                                       ) -> None:
    chats = {"messages": [[{"role": "user", "content": "hello"}]]}
    response = post(base_model_server, "/v1/classify", chats)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "send input" in error["message"]
    classified = post(base_model_server, "/v1/classify", {"input": ["hello", [5, 6, 7]]})
    assert classified.status_code == 200, classified.text
    assert [item["index"] for item in classified.json()["data"]] == [0, 1]
