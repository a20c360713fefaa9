"""`radix-mlx serve --tensor-parallel 2`: two ranks through mlx.launch (ring backend on
127.0.0.1, the CPU), the tiny llama demo model (4 query heads, 2 KV heads: 2 and 1 per
rank) sharded by mlx-lm.

One server serves every test here, in file order; the last one kills a rank.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from mlx import nn
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from engine.engine import device_memory_bytes
from tests.server.support import REPO_ROOT, ServerProcess, server_env, start_server

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], list(range(100, 160)), [42] * 20]
MAX_TOKENS = 16
# Sharded matmuls add in another order than one process does: a float32 logprob may move
# by a few ulps of its magnitude, never more than this.
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tp_server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[ServerProcess]:
    log_path = tmp_path_factory.mktemp("tensor-parallel") / "server.log"
    server = start_server(demo_model_dir, log_path, "--tensor-parallel", "2",
                          "--collective-timeout", "300", cache_bytes=None)
    yield server
    server.stop()


def reference(model: nn.Module, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from one process, as mlx_lm.generate computes
    them: the prompt's forward, then one token at a time."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[:, -1, :]
    tokens, logprobs = [], []
    for _ in range(MAX_TOKENS):
        distribution = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = mx.argmax(distribution, axis=-1).item()
        tokens.append(token)
        logprobs.append(distribution[0, token].item())
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
    return tokens, logprobs


def complete(server: ServerProcess, prompt: list[int], **extra: object) -> dict:
    response = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "logprobs": 1, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def test_greedy_output_is_one_process_output(tp_server: ServerProcess,
                                            demo_model_dir: Path) -> None:
    model, tokenizer = load(str(demo_model_dir))
    for prompt in PROMPTS:
        tokens, logprobs = reference(model, prompt)
        choice = complete(tp_server, prompt)["choices"][0]
        served = choice["logprobs"]["token_logprobs"]
        # Logprobs agree token by token up to the first difference in the text, if any
        # (a near-tie that the order of additions flips); here there is none.
        assert served == pytest.approx(logprobs, abs=LOGPROB_TOLERANCE)
        # Token by token (the completions API names tokens by their text).
        assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in tokens]


def test_each_rank_plans_for_its_half_of_the_hosts_memory(tp_server: ServerProcess) -> None:
    """Both ranks share this host's memory: each plans for half of what one process
    would, its prefix cache included (half the limit, less its shard of the weights)."""
    metrics = tp_server.metrics()
    limit, weights = metrics["radix_mlx_memory_limit_bytes"], metrics["radix_mlx_weight_bytes"]
    assert limit == device_memory_bytes() // 2
    cache = httpx.get(f"{tp_server.url}/admin/cache", timeout=10).json()["memory"]
    assert cache["capacity_bytes"] == int(limit * 0.5) - weights


def test_a_repeated_prompt_is_served_from_every_ranks_cache(
        tp_server: ServerProcess) -> None:
    prompt = list(range(300, 364))
    first = complete(tp_server, prompt)
    second = complete(tp_server, prompt)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_a_cancelled_request_leaves_the_others_running_and_nothing_pinned(
        tp_server: ServerProcess) -> None:
    body = {"prompt": list(range(500, 540)), "max_tokens": 4000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{tp_server.url}/v1/completions", json=body,
                      timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        other = complete(tp_server, PROMPTS[0])  # decoded beside the streaming one
    # The stream is closed: its request is cancelled within a step on every rank.
    assert other["choices"][0]["finish_reason"] == "length"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        cache = httpx.get(f"{tp_server.url}/admin/cache", timeout=10).json()["memory"]
        if tp_server.metrics()["radix_mlx_running_requests"] == 0 and \
                cache["pinned_bytes"] == 0:
            break
        time.sleep(0.2)
    assert tp_server.metrics()["radix_mlx_running_requests"] == 0
    assert cache["pinned_bytes"] == 0 and cache["bytes"] > 0
    assert complete(tp_server, PROMPTS[1])["choices"][0]["finish_reason"] == "length"


def test_a_lost_rank_fails_the_server_without_a_hang(tp_server: ServerProcess) -> None:
    """Rank 1 killed mid-stream: the stream ends with an error, from then on /health
    says failed (while rank 0 still answers: it exits once failed), and the launcher
    exits 1 instead of hanging, so a service manager restarts it. What tells rank 0 is
    the ring's failed send or mlx.launch's signal, whichever comes first; never the
    collective timeout, which is longer than this test waits."""
    body = {"prompt": PROMPTS[2], "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{tp_server.url}/v1/completions", json=body,
                      timeout=30) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        subprocess.run(["kill", "-KILL", str(_rank_pid(tp_server, 1))], check=True)
        rest = "\n".join(lines)
    assert '"code":"engine_error"' in rest and rest.strip().endswith("[DONE]")
    health = _health_until_gone(tp_server.url)
    assert all(status == 503 and body["status"] in ("failed", "draining")
               for status, body in health), health
    assert tp_server.process.wait(timeout=30) == 1
    assert re.search(r"the tensor-parallel group failed: (\[ring\] connection to a peer "
                     r"was lost|another rank exited)", tp_server.log())


def _health_until_gone(url: str) -> list[tuple[int, dict]]:
    seen = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            response = httpx.get(f"{url}/health", timeout=2)
        except httpx.TransportError:
            break  # rank 0 is gone
        seen.append((response.status_code, response.json()))
        time.sleep(0.02)
    return seen


def _rank_pid(server: ServerProcess, rank: int) -> int:
    """The pid of a rank: the launcher's child mlx.launch started it with MLX_RANK set."""
    launcher = subprocess.run(["pgrep", "-P", str(server.process.pid)], capture_output=True,
                              text=True, check=True).stdout.split()
    ranks = subprocess.run(["pgrep", "-P", launcher[0]], capture_output=True, text=True,
                           check=True).stdout.split()
    for pid in ranks:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"MLX_RANK={rank}".encode() in environ:
            return int(pid)
    raise AssertionError(f"no rank {rank} among {ranks}")


def test_a_model_mlx_lm_cannot_shard_is_a_one_line_error(demo_model_family) -> None:
    gemma = demo_model_family("gemma3_text")
    result = _serve(gemma, "--tensor-parallel", "2")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "radix-mlx serve: mlx-lm cannot shard gemma3_text models for tensor parallelism")


def test_heads_that_do_not_split_evenly_are_a_one_line_error(demo_model_dir: Path) -> None:
    result = _serve(demo_model_dir, "--tensor-parallel", "3")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "radix-mlx serve: llama: num_attention_heads = 4 does not split 3 ways")


def _serve(model: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "server", "--model", str(model), "--config", "", *flags],
        cwd=REPO_ROOT, env=server_env(), capture_output=True, text=True, timeout=60,
        check=False)


