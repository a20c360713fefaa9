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
    "max_tokens": 8, "stream": False}


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
    assert post(studio, "/v1/chat/completions", {**RHYMES, "max_tokens": 1}).is_success
    tiny = get(studio, "/api/v0/models/tiny").json()
    assert tiny == get(studio, "/api/v0/models").json()["data"][0]
    assert tiny == {**models["tiny"], "state": "loaded"}
    assert get(studio, "/api/v0/models/spare").json()["state"] == "not-loaded"


def test_an_unknown_model_is_lm_studios_404(studio: ServerProcess) -> None:
    """LM Studio's errors are OpenAI's error object, though its API shares Ollama's /api."""
    for response in (get(studio, "/api/v0/models/no-such-model"),):
        assert response.status_code == 404
        error = response.json()["error"]
        assert (error["type"], error["param"], error["code"]) == (
            "invalid_request_error", "model", "model_not_found")
        assert "no-such-model" in error["message"]
