"""Why a prompt missed the cache: the access log says it for every request, and with
--cache-miss-details the OpenAI usage says it too, with the text on either side."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.support import API_KEY, ServerProcess, start_server

SYSTEM = "You are a coding agent. Today is Monday. Work in the repository and call tools."


@pytest.fixture(scope="module")
def miss_server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("cache-miss") / "server.log"
    process = start_server(demo_model_dir, log, "--api-key", API_KEY, "--cache-miss-details",
                           "true", "--warm-up", "on")
    yield process
    process.stop()


def chat(server: ServerProcess, system: str, user: str, request_id: str):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    return client.chat.completions.with_raw_response.create(
        model=server_model(server), max_tokens=2, temperature=0, extra_headers={"x-request-id": request_id},
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
    ).parse()


def server_model(server: ServerProcess) -> str:
    return httpx.get(f"{server.url}/v1/models", timeout=10,
                     headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"][0]["id"]


def test_a_first_prompt_was_never_seen(miss_server):
    """Whatever the warm-up cached and cleared before the server was ready (its prompts
    start with token ids that chat templates start with too) is no request's cache."""
    server = miss_server
    response = chat(server, SYSTEM + " Unique 1.", "Hello there.", "miss-first")
    miss = response.usage.prompt_tokens_details.cache_miss
    assert miss["reason"] == "not_seen" and miss["position"] == 0
    assert response.usage.prompt_tokens_details.cached_tokens == 0
    assert "miss=not_seen@0" in server.access_line("miss-first")


def test_a_changed_date_in_the_system_prompt_is_a_divergence_at_its_token(miss_server):
    server = miss_server
    chat(server, SYSTEM, "List the files.", "miss-monday")
    response = chat(server, SYSTEM.replace("Monday", "Tuesday"), "List the files.",
                    "miss-tuesday")
    details = response.usage.prompt_tokens_details
    miss = details.cache_miss
    assert miss["reason"] == "diverged" and miss["position"] == details.cached_tokens > 0
    assert miss["before"].endswith("Today is") and miss["after"].startswith(" Tuesday")
    assert miss["cached"].startswith(" Monday")
    assert f"miss=diverged@{miss['position']}" in server.access_line("miss-tuesday")


def test_a_cleared_prefix_says_cleared(miss_server):
    server = miss_server
    chat(server, SYSTEM + " Cleared.", "Hi.", "miss-before-clear")
    cleared = httpx.delete(f"{server.url}/admin/cache", timeout=30,
                           headers={"Authorization": f"Bearer {API_KEY}"})
    assert cleared.status_code == 200, cleared.text
    response = chat(server, SYSTEM + " Cleared.", "Hi.", "miss-after-clear")
    assert response.usage.prompt_tokens_details.cache_miss["reason"] == "cleared"


def test_without_the_setting_usage_keeps_openais_shape(client, model_id):
    response = client.chat.completions.with_raw_response.create(
        model=model_id, max_tokens=1, messages=[{"role": "user", "content": "Shape?"}])
    details = response.http_response.json()["usage"]["prompt_tokens_details"]
    assert list(details) == ["cached_tokens"]


def test_without_a_prefix_cache_a_miss_says_the_cache_is_off(
        demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A budget too small for one token (and no disk tier) keeps nothing: every prompt
    misses at its first token because the cache is off, not because an earlier prompt
    that began with the same token was evicted."""
    log = tmp_path_factory.mktemp("cache-off") / "server.log"
    server = start_server(demo_model_dir, log, "--api-key", API_KEY, "--cache-miss-details",
                          "true", cache_bytes=1)
    try:
        reasons = [chat(server, SYSTEM + f" Unique {n}.", "Hello there.", f"off-{n}")
                   .usage.prompt_tokens_details.cache_miss["reason"] for n in range(2)]
        assert reasons == ["cache_off", "cache_off"]
        assert "miss=cache_off@0" in server.access_line("off-1")
    finally:
        server.stop()
