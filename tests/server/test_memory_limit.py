"""A server whose memory limit holds the KV of 1000 tokens: a request that alone needs
more is refused with a 400 naming the limit; two that together need more take turns."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import mlx.core as mx
import pytest

from engine.memory import headroom
from engine.scheduler import CPU_PREFILL_CHUNK
from server.config import Settings
from tests.server.support import API_KEY, ServerProcess, start_server

CACHE_BYTES = 256 * 2**20  # start_server's
KV_TOKENS = 1000
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def kv_bytes_per_token(model_dir: Path) -> int:
    """K and V of every layer, float32: from the config, not from the engine."""
    config = json.loads((model_dir / "config.json").read_text())
    return (config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"]
            * 2 * 4)


@pytest.fixture(scope="module")
def limited(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[ServerProcess]:
    weights = sum(a.nbytes for a in mx.load(str(demo_model_dir / "model.safetensors")).values())
    vocab = json.loads((demo_model_dir / "config.json").read_text())["vocab_size"]
    per_token = kv_bytes_per_token(demo_model_dir)
    defaults = Settings.model_fields
    verify = defaults["max_batch_size"].default * defaults["speculation_max_draft"].default
    limit = (weights + CACHE_BYTES + headroom(CPU_PREFILL_CHUNK, vocab, per_token, verify)
             + KV_TOKENS * per_token)
    process = start_server(demo_model_dir, tmp_path_factory.mktemp("memory") / "server.log",
                           "--api-key", API_KEY, "--memory-limit-bytes", str(limit))
    yield process
    process.stop()


def test_the_plan_is_reported(limited: ServerProcess) -> None:
    metrics = limited.metrics()
    assert metrics["radix_mlx_kv_token_capacity"] == KV_TOKENS
    assert "memory plan: limit" in limited.log()


def test_a_request_over_the_memory_limit_alone_gets_a_400(limited: ServerProcess) -> None:
    body = {"prompt": [5, 6, 7, 8], "max_tokens": KV_TOKENS - 3}
    response = httpx.post(f"{limited.url}/v1/completions", json=body, headers=AUTH, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert f"holds the KV of {KV_TOKENS} tokens" in error["message"]
    body["max_tokens"] = KV_TOKENS - 4  # exactly the capacity: served
    assert httpx.post(f"{limited.url}/v1/completions", json=body, headers=AUTH,
                      timeout=120).status_code == 200


async def test_requests_that_together_exceed_it_take_turns(limited: ServerProcess) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 600, "ignore_eos": True, "stream": True}
    seen: list[dict[str, float]] = []

    async def stream(client: httpx.AsyncClient) -> int:
        tokens = 0
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    tokens += 1
                    if not seen:  # one request runs: the other must be waiting
                        seen.append(limited.metrics())
        return tokens

    async with httpx.AsyncClient(base_url=limited.url, headers=AUTH, timeout=300) as client:
        counts = await asyncio.gather(stream(client), stream(client))
    assert min(counts) > 0
    during = seen[0]
    assert during["radix_mlx_running_requests"] == 1
    assert during["radix_mlx_queue_depth"] == 1
    assert during["radix_mlx_tokens_in_flight"] == 603
