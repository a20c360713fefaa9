"""`--kv-bits 8` on the real default model, through the server: the prefix cache is
reused and holds quantized tokens (SmolLM2-135M: 30 layers x 3 KV heads x 64, float32 on
the CPU, 46080 bytes a token, 12960 quantized)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.support import API_KEY, ServerProcess, read_metrics, start_server, wait_idle
from tests.server.test_real_model import QUESTION, chat, post

QUANTIZED_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 1 + 30 * 3 * 2 * 8  # packed + scale and bias


@pytest.fixture(scope="module")
def kv8_server(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[ServerProcess]:
    log_path = tmp_path_factory.mktemp("kv8-server") / "server.log"
    process = start_server(real_model_dir, log_path, "--api-key", API_KEY, "--kv-bits", "8")
    yield process
    process.stop()


async def test_a_kv8_server_reuses_its_quantized_cache(kv8_server: ServerProcess) -> None:
    follow_up = [*QUESTION, {"role": "assistant", "content": "Paris."},
                 {"role": "user", "content": "And of Italy?"}]
    async with httpx.AsyncClient(base_url=kv8_server.url, timeout=120) as client:
        cold = await post(client, chat(QUESTION))
        # The cold reply's next-turn prefill done first: a hit decoding in a batch beside
        # it computes other float sums, which 8-bit rounding can turn into another answer.
        wait_idle(kv8_server)
        hit = await post(client, chat(QUESTION))
        turn = await post(client, chat(follow_up))
    # The hit resumes where the cold prompt's one chunk ended: the same KV, the same answer.
    assert hit["choices"][0]["message"] == cold["choices"][0]["message"]
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert turn["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    metrics = read_metrics(kv8_server.url, API_KEY)
    assert metrics["radix_mlx_tree_tokens"] > 0
    assert (metrics["radix_mlx_tree_bytes"]
            == metrics["radix_mlx_tree_tokens"] * QUANTIZED_BYTES_PER_TOKEN)
    log = kv8_server.log_path.read_text()
    assert f"at {QUANTIZED_BYTES_PER_TOKEN} B/token" in log  # the memory plan's line
